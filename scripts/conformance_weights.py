"""Check the weight-transfer key sets the push sends (``protocol.vllm``) against
vLLM's own dataclasses, for each release we speak (0.26 and 0.33). Not part
of the suite: it needs vLLM's sources or an installed vLLM.

    python scripts/conformance_weights.py --source 0.26=/path/to/vllm-0.26/src/vllm
    python scripts/conformance_weights.py            # the installed vllm, if it imports

With ``--source`` it reads the classes' fields from the files (``ast``, so
none of vLLM's dependencies are needed: its engine modules import zmq, ray,
...); without, it imports the installed release's classes (the version
decides which dialect they are compared with). The exit status is 1 when a
set differs. ``conformance.py`` runs the installed check too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtitan_grpo.protocol import vllm  # noqa: E402

# (module, class) in vllm/distributed/weight_transfer -> the keys we send it, per release
CLASSES = {
    "0.26": {("nccl_common", "NCCLWeightTransferInitInfo"): vllm.INIT_INFO_KEYS_0_26,
             ("nccl_engine", "NCCLWeightTransferUpdateInfo"): vllm.UPDATE_INFO_KEYS_0_26,
             ("ipc_engine", "IPCWeightTransferInitInfo"): vllm.IPC_INIT_INFO_KEYS,
             ("ipc_engine", "IPCWeightTransferUpdateInfo"): vllm.IPC_UPDATE_INFO_KEYS},
    "0.33": {("nccl_common", "NCCLWeightTransferInitInfo"): vllm.INIT_INFO_KEYS,
             ("nccl_engine", "NCCLWeightTransferUpdateInfo"): vllm.UPDATE_INFO_KEYS},
}


def fields_from_source(root: Path, module: str, cls: str) -> set[str] | None:
    """The annotated fields of ``cls`` (and of its bases defined beside it)
    in vllm/distributed/weight_transfer/, preferring ``module``.py (classes
    move between its files across releases); None if no file defines it."""
    folder = root / "distributed" / "weight_transfer"
    files = sorted(folder.glob("*.py"), key=lambda f: f.stem != module)
    for path in files:
        classes = {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
        if cls not in classes:
            continue

        def own(name: str) -> set[str]:
            node = classes[name]
            out = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    out |= own(base.id)
            return out

        return own(cls)
    return None


def fields_installed(module: str, cls: str) -> set[str] | None:
    try:
        m = importlib.import_module(f"vllm.distributed.weight_transfer.{module}")
    except ImportError:
        return None
    c = getattr(m, cls, None)
    return {f.name for f in dataclasses.fields(c) if f.init} if c is not None else None


def check(release: str, get) -> list[str]:
    """One line per class: ok, differs (naming the keys) or absent."""
    lines = []
    for (module, cls), ours in CLASSES[release].items():
        theirs = get(module, cls)
        if theirs is None:
            lines.append(f"absent  {release} {module}.{cls}")
            continue
        theirs = {k for k in theirs if k != "rank"}  # trainer-side base field, never in a body
        missing, extra = sorted(theirs - ours), sorted(ours - theirs)
        status = "ok     " if not (missing or extra) else "DIFFERS"
        lines.append(f"{status} {release} {module}.{cls}" + (f": vLLM has {missing} we lack, we send {extra} "
                                                            f"it refuses" if missing or extra else ""))
    return lines


def installed_release() -> str | None:
    try:
        version = importlib.import_module("vllm").__version__
    except Exception:  # noqa: BLE001 - not installed, or its import needs what is missing here
        return None
    return vllm.nearest_dialect(version)[0].release


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", action="append", default=[], metavar="RELEASE=DIR",
                   help="a release's vllm package directory (the one holding distributed/), e.g. 0.26=src/vllm")
    a = p.parse_args(argv)
    lines: list[str] = []
    for spec in a.source:
        release, _, root = spec.partition("=")
        if release not in CLASSES:
            p.error(f"--source {spec}: release must be one of {sorted(CLASSES)}")
        lines += check(release, lambda m, c, r=Path(root): fields_from_source(r, m, c))
    if not a.source:
        release = installed_release()
        if release is None:
            print("vllm does not import here; give --source RELEASE=DIR")
            return 1
        lines += check(release, fields_installed)
    print("\n".join(lines))
    return 1 if any(not line.startswith("ok") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
