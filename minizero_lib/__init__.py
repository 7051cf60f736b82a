"""minizero's supporting modules, under one name of the project's own, so that a user's
engine.py or checkpoint.py never shadows them. The library's face is minizero.py; the ring
collectives and the communicators are ops.py; README.md's reading guide gives the order."""
