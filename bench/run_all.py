"""Run every benchmark and write docs/BENCHMARKS.md (and its plots) from what they print.

    .venv/bin/python bench/run_all.py            # make bench: the full set, well under 30 min
    .venv/bin/python bench/run_all.py --quick    # make bench-quick: a smaller set, under 3 min

Each section carries the command that produced it; each number is reproducible by it.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return (
        f"Machine: {cpu}, {os.cpu_count()} cores, {memory:.1f} GiB RAM, "
        f"Linux {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}. A VM whose host caches the "
        "disk: evicted means guest-cold, not device-cold. Noisy (2-4x between identical runs): "
        "read medians and paired ratios, not single numbers."
    )


def run(script: str, *args: str, markdown: bool = False) -> str:
    """Run one benchmark; return its markdown (from --markdown, or what it printed)."""
    command = [sys.executable, f"bench/{script}", *args]
    print(f"$ {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    if markdown:
        out = ROOT / "bench" / f".{script}.md"
        subprocess.run([*command, "--markdown", str(out)], cwd=ROOT, check=True)
        text = out.read_text()
        out.unlink()
    else:
        text = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    print(f"  ({time.monotonic() - start:.0f} s)", flush=True)
    return text


FAIRNESS = (
    "A root daemon (8 workers, `--socket-group`) and two unprivileged users over an "
    "emulated network mount (20 ms per seek, 8 MiB/s per stream, 64 MiB/s in all). The "
    "victim warms a 64 MiB file (evicted before each run); the flooder keeps 20 Warm streams "
    "over 20 files of 1 GiB. *same uid*: the victim's request sent under the flooder's uid, "
    "i.e. what sharing the workers per request (before per-user fair share) gives.\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=DOCS / "BENCHMARKS.md")
    args = parser.parse_args()
    quick = args.quick
    daemon = ["--status-calls", "100"] if quick else []
    sections = [
        "# Benchmarks\n",
        "Written by `" + ("make bench-quick" if quick else "make bench") + "` "
        f"(`python bench/run_all.py{' --quick' if quick else ''}`) "
        f"on {time.strftime('%Y-%m-%d')}.\n",
        machine() + "\n",
        "## Planning speed\n",
        "```console\npython bench/bench_planning.py" + (" --repeat 5" if quick else "") + "\n```\n",
        run("bench_planning.py", *(["--repeat", "5"] if quick else [])),
        "## Daemon responsiveness\n",
        "```console\npython bench/bench_daemon.py"
        + (" --status-calls 100" if quick else "")
        + "\n```\n",
        "\n".join(f"- {line}" for line in run("bench_daemon.py", *daemon).splitlines()),
        # "## Load: many ranks and many requests" (the script writes its own heading)
        run("bench_load.py", *(["--quick"] if quick else []), markdown=True),
        "\n## What one request may cost: the work limits\n",
        run("bench_limits.py", markdown=True),
        "\n## Fairness between users\n",
        "```console\nsudo python bench/bench_fairness.py\n```\n",
        FAIRNESS,
        run("bench_fairness.py", markdown=True),
        "\n## Scale\n",
        run("bench_scale.py", *(["--quick"] if quick else [])),
    ]
    engine = ["--quick"] if quick else ["--sizes", "1GiB,2GiB"]
    sections.append(
        run("bench_engine.py", *engine, "--plot", str(DOCS / "bench_engine.png"), markdown=True)
    )
    sections.append("\n![warm engine vs tools](bench_engine.png)\n")
    spans = ["--mounts", "local", "--reps", "1"] if quick else ["--reps", "3"]
    sections.append(
        run("bench_spans.py", *spans, "--plot", str(DOCS / "bench_spans.png"), markdown=True)
    )
    sections.append("\n![spans vs whole file](bench_spans.png)\n")
    seek = ["--mounts", "local", "--reps", "1"] if quick else ["--reps", "3"]
    sections.append(run("bench_seek_cost.py", *seek, markdown=True))
    e2e = ["--mounts", "local", "--layouts", "packed", "--reps", "1"] if quick else ["--reps", "3"]
    sections.append(run("bench_end_to_end.py", *e2e, markdown=True))
    repeat = ["--repeat", "1" if quick else "3"]
    sections += [
        "## transformers: what each node reads\n",
        "```console\npython bench/bench_transformers_plan.py " + " ".join(repeat) + "\n```\n",
        "Sparse checkpoints with the key names and shapes transformers saves; per node of a "
        "4-node x 8-rank job, the bytes its ranks read (`spanwarm plan MODEL_DIR`), the "
        "expert part, and what the seed read (converted tensors whole on every node). The "
        "last column is the `spanwarm plan` command's wall time.\n",
        run("bench_transformers_plan.py", *repeat),
    ]
    tf_load = ["--mounts", "local", "--reps", "1"] if quick else ["--reps", "3"]
    sections.append(run("bench_transformers_load.py", *tf_load, markdown=True))
    dcp = ["--mounts", "local", "--reps", "1"] if quick else ["--reps", "3"]
    sections.append(run("bench_dcp_resume.py", *dcp, markdown=True))
    args.output.write_text("\n".join(sections) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
