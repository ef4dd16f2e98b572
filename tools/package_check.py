"""Install a built wheel into a fresh virtual environment and run the README's example.

    python tools/package_check.py dist/ddp_avg_hooks-*.whl [--torch 'torch==2.13.0']
                                  [--find-links /opt/wheels] [--keep]

In a new temporary folder, outside the repository: a virtual environment, the given torch
and the wheel. Then, from that folder:

1. ``ddp_avg_hooks`` imports from the environment (not the repository), with its
   ``__version__`` and every file of the repository's ``csrc/``;
2. the extension builds from those sources (skipped with ``DDP_AVG_HOOKS_DISABLE_EXT=1``,
   for a machine without a C++ compiler);
3. the README's training example runs under
   ``python -m torch.distributed.run --standalone --nproc-per-node 2`` and both ranks
   print a finite last loss (below 2, from about 30) and their ``AveragingStats``;
4. two of the repository's examples, copied next to it, train against the installed
   package: ``examples/local_sgd.py`` (DDP, 2 ranks; again with uneven inputs, one rank
   20 batches short, inside ``Join``) and ``examples/fsdp2.py`` (2 replica
   groups of 2 FSDP2 shards, 4 ranks), the latter started again on its round checkpoints,
   which it must resume; each must end with its replicas agreed.

``make package-check`` runs it on the wheel ``make package`` built.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# a rank's "loss 0.071" (the example prints three decimals): found even where the two
# ranks' prints interleave piece by piece, and nan or inf where one diverged
_LOSS = r"loss (nan|-?inf|-?\d+\.\d{3})"

ROOT = Path(__file__).resolve().parents[1]

# (script, ranks, arguments, what its output must hold); run in this order
EXAMPLES = [
    ("local_sgd.py", 2, [], ["replicas agreed after every round"]),
    ("local_sgd.py", 2, ["--uneven", "20"],
     ["1 of 2 ranks ran out of batches early; every rank took part in all 7 rounds (66 steps)",
      "replicas agreed at the end"]),
    ("fsdp2.py", 4, ["--steps", "30", "--dir", "fsdp2_run"],
     ["round 3:", "replicas agreed after every round"]),
    ("fsdp2.py", 4, ["--steps", "40", "--dir", "fsdp2_run"],
     ["resumed round 3 at step 27", "round 4:", "replicas agreed after every round"]),
]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _check(ok: bool, message: str) -> None:
    if not ok:
        sys.exit(f"package check failed: {message}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("--torch", default="torch==2.13.0", help="the torch requirement to install")
    p.add_argument("--find-links", default=None, help="a folder of local wheels for pip")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = p.parse_args(argv)
    wheel = a.wheel.resolve()
    example = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]

    tmp = Path(tempfile.mkdtemp(prefix="ddp_avg_hooks_package_check_"))
    try:
        venv = tmp / "venv"
        python = str(venv / "bin" / "python")
        _run([sys.executable, "-m", "venv", str(venv)])
        links = ["--find-links", a.find_links] if a.find_links else []
        _run([python, "-m", "pip", "install", "-q", *links, a.torch, str(wheel)])

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"))
        where = _run([python, "-c", "import ddp_avg_hooks, pathlib; "
                      "here = pathlib.Path(ddp_avg_hooks.__file__).parent; "
                      "print(ddp_avg_hooks.__version__); print(here); "
                      "print(*sorted(f.name for f in (here / 'csrc').iterdir()))"],
                     cwd=tmp, env=env).stdout.splitlines()
        version, location, sources = where[0], Path(where[1]), set(where[2].split())
        _check(location.resolve().is_relative_to(venv.resolve()),
               f"imported from {location}, not from the wheel")
        missing = {f.name for f in (ROOT / "csrc").iterdir() if f.is_file()} - sources
        _check(not missing, f"the installed package lacks csrc/{sorted(missing)}")
        print(f"ddp_avg_hooks {version} from {location}, csrc: {len(sources)} files")

        if env.get("DDP_AVG_HOOKS_DISABLE_EXT", "") in ("", "0"):
            backend = _run([python, "-c", "from ddp_avg_hooks import ops; print(ops.backend())"],
                           cwd=tmp, env=env).stdout.split()[-1]
            _check(backend == "extension",
                   "the extension did not build from the wheel's sources (a C++ compiler is "
                   "needed; DDP_AVG_HOOKS_DISABLE_EXT=1 checks the rest without it)")
            print("ops backend: extension, built from the installed sources")

        (tmp / "train.py").write_text(example)
        out = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    "2", "train.py"], cwd=tmp, env=env, timeout=600).stdout
        stats = re.findall(r"AveragingStats\(rounds=\d+[^)]*\)", out)  # ranks may share a line
        _check(len(stats) == 2, f"expected the stats of 2 ranks, got:\n{out}")
        losses = [float(v) for v in re.findall(_LOSS, out)]
        _check(len(losses) == 2 and all(0.0 <= v < 2.0 for v in losses),
               f"expected both ranks to train (a last loss below 2), got:\n{out}")
        print(*(f"loss {v} {s}" for v, s in zip(losses, stats)), sep="\n")

        shutil.copytree(ROOT / "examples", tmp / "examples",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for script, nproc, args, expect in EXAMPLES:
            cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(nproc), str(tmp / "examples" / script), *args]
            out = _run(cmd, cwd=tmp, env=env, timeout=600).stdout
            run = " ".join([f"examples/{script}", *args])
            for text in expect:
                _check(text in out, f"{run}: no {text!r} in:\n{out}")
            print(f"{run}: {expect[-1]}")
        print(f"package check passed: {wheel.name}")
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
