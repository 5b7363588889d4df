"""How long a Spark Python process takes to be ready, as the streaming source's runner starts.

    ./dev bench runner_start [--rounds 5] [--load 30]

Each start is a new Python that imports what the runner imports before it connects back to the
JVM (``pyspark.sql.streaming.python_streaming_source_runner`` and tierlog's source module), with
the ``PYTHONPATH`` Spark gives it (the installed pyspark's ``pyspark.zip`` and py4j first):

zip         ``sys.executable`` as Spark started it before (the baseline): pyspark compiled
            from the zip at every start;
launcher    ``streaming.runtime.session.worker_python``'s launcher, which takes the zip off the path.

Both idle and with ``--load`` busy processes on the machine (a broker host's load, issue 33),
``--rounds`` rounds in alternating order; CPU seconds (user + system of the child) and wall
seconds, medians.  Spark gives the runner 10 s to connect back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time

from bench.common import report

IMPORTS = "import pyspark.sql.streaming.python_streaming_source_runner, streaming.sources.commitlog"


def spark_pythonpath() -> str:
    import pyspark

    lib = os.path.join(os.path.dirname(pyspark.__file__), "python", "lib")
    zips = [os.path.join(lib, n) for n in sorted(os.listdir(lib)) if n.endswith(".zip")]
    zips.sort(key=lambda p: not p.endswith("pyspark.zip"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(zips + [root])


def start(python: str, env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([python, "-c", IMPORTS], env=env, check=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def measure(pythons: dict, env: dict, rounds: int) -> dict:
    got = {name: {"wall": [], "cpu": []} for name in pythons}
    names = list(pythons)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            wall, cpu = start(pythons[name], env)
            got[name]["wall"].append(wall)
            got[name]["cpu"].append(cpu)
    return {name: {"wall_s": round(statistics.median(v["wall"]), 3), "cpu_s": round(statistics.median(v["cpu"]), 3),
                   "wall_rounds_s": [round(x, 2) for x in v["wall"]]} for name, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load", type=int, default=30, help="busy processes for the loaded runs (default 30)")
    args = ap.parse_args()
    from streaming.runtime.session import worker_python

    launcher = worker_python("local[2]")
    if launcher == sys.executable:
        raise SystemExit("no launcher here: SPARK_HOME is another Spark, or ~/.cache/tierlog is not writable or is noexec")
    env = {**os.environ, "PYTHONPATH": spark_pythonpath()}
    pythons = {"zip": sys.executable, "launcher": launcher}
    out = {"benchmark": "runner_start", "imports": IMPORTS, "rounds": args.rounds, "cpus": os.cpu_count()}
    out["idle"] = measure(pythons, env, args.rounds)
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    try:
        time.sleep(1)
        out[f"load_{args.load}"] = measure(pythons, env, args.rounds)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    for case in ("idle", f"load_{args.load}"):
        out[case]["launcher_vs_zip_cpu"] = round(out[case]["launcher"]["cpu_s"] / out[case]["zip"]["cpu_s"], 2)
        out[case]["launcher_vs_zip_wall"] = round(out[case]["launcher"]["wall_s"] / out[case]["zip"]["wall_s"], 2)
    report(out)


if __name__ == "__main__":
    main()
