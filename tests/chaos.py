"""
Chaos: kill a training run at random moments, and show that it loses nothing.

    python tests/chaos.py --kills 5 --world-size 2 --stage 0
    python tests/chaos.py --kills 5 --world-size 4 --stage 3 --offload disk
    python tests/chaos.py --elastic 2 --world-size 4   # killed at 4 ranks, restarted at 2
    python tests/chaos.py --elastic 2 --world-size 4 --reduce-order tree   # ...to the bit
    python tests/chaos.py --kills 0 --model demo       # the demo's GPT: the stall per save

It runs train_gpt.py under torchrun --max-restarts M with --out-dir D --resume (one command
for the start and every restart) and kills it M times at moments drawn from --seed: a random
rank, or every rank, with SIGKILL, a random time after a random step, or while a checkpoint
is being written (once a step-N folder has new files but no manifest, every worker is
stopped with SIGSTOP, and the kill lands in the save). Then it compares the run with the same
run never killed, saving blocking: the final checkpoint's consolidated state, bit for bit,
and the loss of every step trained (the retrained ones too) and of every eval (log.jsonl).
Linux only (it finds the workers in /proc).
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, HERE)
import torch  # noqa: E402

from minizero_lib import checkpoint, resume  # noqa: E402

TINY = ["--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8",
        "--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "1"]


def demo_args(a, out_dir, data, background=True):
    """train_gpt.py's options for this chaos run: the same for the start and every restart."""
    args = ["--out-dir", out_dir, "--resume", "--stage", str(a.stage), "--steps", str(a.steps),
            "--save-interval", str(a.save_interval), "--eval-interval", str(a.eval_interval),
            "--data", data, "--dropout", str(a.dropout), "--seed", str(a.seed),
            "--reduce-order", a.reduce_order]
    args += TINY if a.model == "tiny" else []
    args += [] if background else ["--no-background-save"]
    if a.offload:
        args += ["--offload", a.offload, "--offload-dir", os.path.join(a.tmp, "offload")]
    return args


def torchrun(world_size, args, restarts, out):
    """Start train_gpt.py under torchrun (in a session of its own, so that it ends whole)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", f"--max-restarts={restarts}", "train_gpt.py", *args]
    env = dict(os.environ, PYTHONPATH=HERE, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=HERE, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def finish(proc, out, timeout=900):
    """Wait for torchrun; its exit status. A run past the timeout is killed whole."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        print(f"torchrun ran past {timeout} s and was killed; its output: {out.name}")
        return -9


def stop(proc):
    """Kill torchrun and its workers (they have sessions of their own), if still running."""
    if proc.poll() is None:
        signal_all(workers(proc.pid).values(), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workers(pid):
    """{rank: pid} of the live train_gpt.py workers below process `pid` (torchrun)."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
            kids = "".join(open(f"/proc/{p}/task/{t}/children").read() for t in tasks)
        except (FileNotFoundError, ProcessLookupError):
            continue
        for k in map(int, kids.split()):
            todo.append(k)
            try:
                cmd, env = (open(f"/proc/{k}/{f}", "rb").read() for f in ("cmdline", "environ"))
                state = open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            rank = [e[5:] for e in env.split(b"\0") if e.startswith(b"RANK=")]
            worker = b"train_gpt.py" in cmd and b"torch.distributed.run" not in cmd
            if worker and rank and state != "Z":
                found[int(rank[0])] = k
    return found


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def saves_in_flight(out_dir, since):
    """The step-N folders newer than the newest complete checkpoint (older ones may be in the
    middle of being pruned) with files written after `since` and no manifest yet."""
    found, newest = [], checkpoint.checkpoints(out_dir)
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        path = os.path.join(out_dir, name)
        if newest and path <= newest[0]:
            continue
        try:
            files = os.listdir(path) if name.startswith("step-") else ["manifest.json"]
            if "manifest.json" not in files and any(os.stat(os.path.join(path, f)).st_mtime >= since
                                                    for f in files):
                found.append(path)
        except FileNotFoundError:  # (pruned, or a file renamed, meanwhile)
            continue
    return found


def plan(a):
    """The kills, drawn from the seed: after which step, in a save or not, whom, how long after."""
    rng = random.Random(a.seed)
    last = a.steps - a.save_interval  # a save in flight must still come after the step drawn
    steps = sorted(rng.sample(range(1, last), a.kills)) if a.kills else []
    kinds = ["save" if i % 2 == 0 else "step" for i in range(a.kills)]
    rng.shuffle(kinds)
    whos = [rng.choice([*range(a.world_size), "every"]) for _ in range(a.kills)]
    if a.kills >= 3 and "every" not in whos:  # the whole worker group at least once
        whos[rng.randrange(a.kills)] = "every"
    return [dict(after=s, kind=k, who=w, delay=rng.uniform(0, 0.05))
            for s, k, w in zip(steps, kinds, whos)]


def kill(proc, k, out_dir, attempt):
    """Wait until the run passes step k["after"] in this attempt, then kill k["who"] (after
    k["delay"] s, or in the next save). Returns what happened, or None if the run ended first."""
    while proc.poll() is None:
        steps = [r["step"] for r in resume.read_log(out_dir)[attempt["records"]:] if "loss" in r]
        if steps and steps[-1] >= k["after"]:
            break
        time.sleep(0.005)
    else:
        return None
    if k["kind"] == "step":
        time.sleep(k["delay"])
    while proc.poll() is None:
        pids = workers(proc.pid)
        if len(pids) < attempt["world_size"]:
            time.sleep(0.005)
            continue
        during = None
        if k["kind"] == "save":
            flight = saves_in_flight(out_dir, attempt["since"])
            if not flight:
                time.sleep(0.001)
                continue
            signal_all(pids.values(), signal.SIGSTOP)  # the world holds still: save still on?
            flight = saves_in_flight(out_dir, attempt["since"])
            if not flight:
                signal_all(pids.values(), signal.SIGCONT)
                continue
            during = os.path.basename(flight[0])
        victims = list(pids.values()) if k["who"] == "every" else [pids[k["who"]]]
        signal_all(victims, signal.SIGKILL)
        signal_all(pids.values(), signal.SIGCONT)
        return dict(k, during=during, pids=set(pids.values()))
    return None


def wait_restart(proc, killed, world_size):
    """Wait until torchrun has a new worker group (every old worker gone); its start time."""
    while proc.poll() is None:
        pids = workers(proc.pid)
        if len(pids) == world_size and not set(pids.values()) & killed["pids"]:
            return time.time()
        time.sleep(0.01)
    return time.time()


def retrained(log, boundary):
    """(steps trained again after a kill, the step the restart resumed at): log[boundary:] is
    what the restart wrote (the workers before it were all gone by then)."""
    before = [r["step"] for r in log[:boundary] if "loss" in r]
    after = [r["step"] for r in log[boundary:] if "loss" in r]
    last, at = before[-1] if before else -1, after[0] if after else before[-1] + 1
    return last + 1 - at, at


def compare(ref_dir, out_dir, steps):
    """(final state bitwise equal, every loss equal, the last step reached, steps trained) of
    the run in out_dir against the one in ref_dir: losses of training (True) and of evals."""
    def losses(d):
        return [("loss" in r, r["step"], r.get("loss", r.get("val")))
                for r in resume.read_log(d) if "loss" in r or "val" in r]
    want, runs = {(t, s): v for t, s, v in losses(ref_dir)}, losses(out_dir)
    same = all(want.get((t, s)) == v for t, s, v in runs)
    same = same and {(t, s) for t, s, _ in runs} == set(want)  # every step and eval, too
    newest = checkpoint.checkpoints(out_dir)
    at_end = bool(newest) and newest[0] == checkpoint.step_dir(out_dir, steps)
    a = checkpoint.consolidate(checkpoint.checkpoints(ref_dir)[0])
    b = checkpoint.consolidate(newest[0])
    state = a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n])
                                         for n in a)
    return state, same, at_end, len([r for r in runs if r[0]])


def stalls(out_dir):
    s = [r["stall_s"] for r in resume.read_log(out_dir) if "stall_s" in r]
    return f"{1000 * sum(s) / max(1, len(s)):.1f} ms ({len(s)} saves)"


def reference(a, data):
    """The run never killed, saving blocking."""
    ref = os.path.join(a.tmp, "reference")
    with open(os.path.join(a.tmp, "reference.out"), "w") as out:
        t0 = time.time()
        rc = finish(torchrun(a.world_size, demo_args(a, ref, data, background=False), 0, out), out)
    if rc != 0:
        sys.exit(f"the reference run failed (exit {rc}); its output: {out.name}")
    print(f"reference (never killed, blocking saves): {a.steps} steps in {time.time() - t0:.1f} s")
    return ref


def chaos(a, data, ref=None):
    """Kill a torchrun run a.kills times; compare it with `ref`, the run never killed (None:
    run it here). True if every kill was survived and every bit is the same."""
    ref = ref or reference(a, data)
    d = os.path.join(a.tmp, "chaos")
    os.makedirs(d)
    open(os.path.join(d, "log.jsonl"), "w").close()
    with open(os.path.join(a.tmp, "chaos.out"), "w") as out:
        proc = torchrun(a.world_size, demo_args(a, d, data), a.kills, out)
        attempt, kills = dict(records=0, since=time.time(), world_size=a.world_size), []
        try:
            for k in plan(a):
                killed = kill(proc, k, d, attempt)
                if killed is None:
                    break
                since = wait_restart(proc, killed, a.world_size)
                attempt = dict(records=len(resume.read_log(d)), since=since,
                               world_size=a.world_size)
                kills.append(dict(killed, boundary=attempt["records"]))
            rc = finish(proc, out)
        finally:
            stop(proc)
    log = resume.read_log(d)
    for i, k in enumerate(kills):
        n, at = retrained(log, k["boundary"])
        k["retrained"] = n
        who = "every rank" if k["who"] == "every" else f"rank {k['who']}"
        when = f"during the save of {k['during']} (no manifest yet)" if k["during"] else \
            f"{k['delay']:.3f} s after step {k['after']}"
        print(f"kill {i + 1}/{a.kills}: SIGKILL {who} {when}; the restart resumed at step {at}: "
              f"{n} steps retrained")
    state, losses, at_end, trained = compare(ref, d, a.steps) if rc == 0 else (0, 0, 0, 0)
    survived = len(kills) if rc == 0 and at_end else 0
    print(f"kills survived {survived}/{a.kills}, "
          f"final state bitwise equal: {'yes' if state else 'no'}")
    print(f"losses equal at every step trained and every eval: {'yes' if losses else 'no'} "
          f"({a.steps} steps, {trained} trained with the retrained)")
    if kills:
        n = [k["retrained"] for k in kills]
        print(f"steps retrained per kill: {', '.join(map(str, n))} (mean {sum(n) / len(n):.1f}, "
              f"a save every {a.save_interval} steps)")
    print(f"stall per save: blocking {stalls(ref)}, background {stalls(d)}")
    if rc != 0:
        print(f"torchrun exited {rc}; its output: {out.name}")
    return survived == a.kills and state and losses


def elastic(a, data):
    """Kill every rank of an a.world_size run once its checkpoint at half way is complete;
    restart at a.elastic ranks; compare with the run never killed."""
    ref = reference(a, data)
    d = os.path.join(a.tmp, "elastic")
    half = a.steps // 2 // a.save_interval * a.save_interval
    with open(os.path.join(a.tmp, "elastic.out"), "w") as out:
        proc = torchrun(a.world_size, demo_args(a, d, data), 0, out)
        try:
            while proc.poll() is None and \
                    checkpoint.step_dir(d, half) not in checkpoint.checkpoints(d):
                time.sleep(0.005)
            signal_all(workers(proc.pid).values(), signal.SIGKILL)
            finish(proc, out)
        finally:
            stop(proc)
        boundary, start = len(resume.read_log(d)), checkpoint.checkpoints(d)[0]
        rc = finish(torchrun(a.elastic, demo_args(a, d, data), 0, out), out)
    if rc != 0:
        sys.exit(f"the restart at {a.elastic} ranks failed (exit {rc}); its output: {out.name}")
    log, want = resume.read_log(d), resume.read_log(ref)
    n, at = retrained(log, boundary)
    print(f"killed all {a.world_size} ranks after step {at + n - 1}; restarted at {a.elastic} "
          f"ranks from {start} (step {at}, {n} steps retrained), at the same global batch")
    print(f"val loss after the restart: {a.world_size} ranks never killed | {a.world_size} ranks, "
          f"then {a.elastic} | difference")
    vals = {r["step"]: r["val"] for r in want if "val" in r}
    for r in log[boundary:]:
        if "val" in r:
            v, w = r["val"], vals[r["step"]]
            print(f"  step {r['step']:4d}: {w:.7f} | {v:.7f} | {v - w:+.2e}")
    x, y = (checkpoint.consolidate(checkpoint.checkpoints(p)[0]) for p in (ref, d))
    diff = max((x[k] - y[k]).abs().max().item() for k in x)
    same = all(torch.equal(x[k], y[k]) for k in x)
    print(f"final state: bitwise equal {'yes' if same else 'no'}, max |difference| {diff:.2e} "
          f"(largest value {max(x[k].abs().max().item() for k in x):.2f})" + (
              f": what differs is the summation order of the gradients ({a.world_size} ranks' "
              f"sums, then {a.elastic} ranks' of more micro-batches each)"
              + (", and the dropout masks (each rank draws its own; --reduce-order tree draws "
                 "each micro-batch's from its own seed)" if a.dropout else "")
              if a.reduce_order == "ring" else ""))
    # --reduce-order tree: the same bits at any world size, every val loss and the final state
    vals_same = all(r["val"] == vals[r["step"]] for r in log[boundary:] if "val" in r)
    return a.reduce_order == "ring" or (same and vals_same)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=0, choices=range(4))
    p.add_argument("--offload", choices=["cpu", "disk"])
    p.add_argument("--model", choices=["tiny", "demo"], default="tiny",
                   help="demo: train_gpt.py's default GPT")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1, help="so that the ranks' RNG matters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--elastic", type=int, help="kill every rank at half way, restart at this many")
    p.add_argument("--reduce-order", choices=["ring", "tree"], default="ring",
                   help="tree: the same bits at any world size, so --elastic's too")
    p.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    a = p.parse_args(argv)
    if a.kills < 0 or a.kills > a.steps - a.save_interval - 1:
        p.error(f"--kills must be from 0 to --steps - --save-interval - 1 "
                f"= {a.steps - a.save_interval - 1}")
    return a


def main():
    a = parse()
    a.tmp = tempfile.mkdtemp(prefix="chaos-")
    data = os.path.join(a.tmp, "data.txt")
    import train_gpt  # (the standard library's own sources: a cut of them is enough)
    with open(data, "wb") as f:
        f.write(train_gpt.stdlib_corpus(200_000))
    what = "demo" if a.model == "demo" else "tiny"
    print(f"chaos: train_gpt.py under torchrun at {a.world_size} ranks, stage {a.stage}"
          f"{', offload ' + a.offload if a.offload else ''}, the {what} GPT, dropout {a.dropout}, "
          f"{a.steps} steps, a save every {a.save_interval}, seed {a.seed}")
    try:
        ok = elastic(a, data) if a.elastic else chaos(a, data)
    finally:
        if a.keep:
            print(f"run folders: {a.tmp}")
        else:
            shutil.rmtree(a.tmp, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
