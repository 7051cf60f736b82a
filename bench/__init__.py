"""The benchmark of minizero against torch's DDP and FSDP2: run it as `python -m bench`
(__main__.py lists the modes; one module per mode, what they share in common.py)."""
