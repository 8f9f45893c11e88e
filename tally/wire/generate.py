"""Regenerate (or check) the committed Python stubs of the wire contract.

    python -m tally.wire.generate           # rewrite tally/wire/v1/ from proto/tally/v1/*.proto
    python -m tally.wire.generate --check   # exit 1, naming the stale files, if they differ

The contract lives in ``proto/tally/v1`` (proto package ``tally.v1``) while the stubs live in the
Python package ``tally.wire.v1``. protoc names imports after the proto path (``from tally.v1
import common_pb2``), so the generated import lines, and the module name the messages register
under, are rewritten to ``tally.wire.v1``. Nothing else is touched: the serialized descriptors
and the gRPC method paths keep the proto package ``tally.v1``, which is the wire contract.

Output depends only on the .proto files and the pinned grpcio-tools (see constraints.txt), so a
test can regenerate into a temporary directory and compare byte for byte. This module must not
import the stubs it generates: it has to run when they are stale or missing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = REPO_ROOT / "tally" / "wire" / "v1"
PROTO_PACKAGE = "tally/v1"  # the proto files' directory under the include root
PY_FROM = "tally.v1"
PY_TO = "tally.wire.v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT = re.compile(rf"^from {re.escape(PY_FROM)} import ", re.MULTILINE)
_MODULE_NAME = re.compile(rf"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, '){re.escape(PY_FROM)}\.")


class GenerationError(RuntimeError):
    pass


def _protoc_include() -> str:
    """grpc_tools ships the well-known types (timestamp, struct) next to its protoc."""
    return str(resources.files("grpc_tools") / "_proto")


def _rewrite(text: str) -> str:
    text = _IMPORT.sub(f"from {PY_TO} import ", text)
    text = _MODULE_NAME.sub(rf"\g<1>{PY_TO}.", text)
    leftover = re.search(rf"^\s*(from|import) {re.escape(PY_FROM)}\b", text, re.MULTILINE)
    if leftover:
        raise GenerationError(f"unrewritten import in generated code: {leftover.group(0)!r}")
    return text


def render(proto_dir: Path = PROTO_DIR) -> dict[str, str]:
    """The stubs for every .proto under ``proto_dir/tally/v1``, as {file name: text}."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # a test extra, not a runtime dependency
        raise GenerationError("grpcio-tools is not installed (pip install -e '.[test]')") from exc
    proto_dir = Path(proto_dir).resolve()
    sources = sorted(p.relative_to(proto_dir).as_posix()
                     for p in (proto_dir / PROTO_PACKAGE).glob("*.proto"))
    if not sources:
        raise GenerationError(f"no .proto files under {proto_dir / PROTO_PACKAGE}")
    with tempfile.TemporaryDirectory(prefix="tally-protoc-") as tmp:
        args = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{_protoc_include()}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *sources]
        code = protoc.main(args)
        if code != 0:
            raise GenerationError(f"protoc failed (exit {code}) on {', '.join(sources)}")
        generated = Path(tmp) / PROTO_PACKAGE
        rendered = {}
        for source in sources:
            stem = Path(source).stem
            for suffix in SUFFIXES:
                name = stem + suffix
                rendered[name] = _rewrite((generated / name).read_text(encoding="utf-8"))
        return rendered


def _committed(out_dir: Path) -> dict[str, str]:
    if not out_dir.is_dir():
        return {}
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(out_dir.iterdir())
            if p.is_file() and p.name.endswith(SUFFIXES)}


def stale_files(proto_dir: Path = PROTO_DIR, out_dir: Path = OUT_DIR) -> list[str]:
    """Generated files that are out of date, missing, or left over from a deleted .proto."""
    rendered, committed = render(proto_dir), _committed(Path(out_dir))
    return sorted(name for name in rendered.keys() | committed.keys()
                  if rendered.get(name) != committed.get(name))


def write(proto_dir: Path = PROTO_DIR, out_dir: Path = OUT_DIR) -> list[str]:
    """Bring ``out_dir`` up to date; returns the files written or removed."""
    out_dir = Path(out_dir)
    rendered, committed = render(proto_dir), _committed(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC stubs of the tally.v1 wire contract."""\n')
    changed = []
    for name, text in sorted(rendered.items()):
        if committed.get(name) != text:
            (out_dir / name).write_text(text, encoding="utf-8")
            changed.append(name)
    for name in sorted(committed.keys() - rendered.keys()):
        (out_dir / name).unlink()
        changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tally.wire.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the committed stubs are stale")
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR,
                        help="include root holding tally/v1/*.proto (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help="where the stubs live (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(args.proto_dir, args.out_dir)
            if stale:
                print(f"generated stubs in {args.out_dir} are out of date with {args.proto_dir}: "
                      f"{', '.join(stale)}; run `python -m tally.wire.generate`", file=sys.stderr)
                return 1
            print(f"stubs in {args.out_dir} are up to date")
            return 0
        changed = write(args.proto_dir, args.out_dir)
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"updated {', '.join(changed)}" if changed else "stubs already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
