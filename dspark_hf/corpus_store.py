"""`dspark-hf corpus`: a regenerated corpus kept in git, so the slowest stage of a drafter is paid once.

Regenerating the target's own answers is hours of CPU; a working session that ends takes its build folder with it.
`pack` compresses every regenerated file of a folder (each with the settings record `regenerate` keeps beside it,
`provenance`) into a corpus directory: one deterministic gzip per file (the same data packs to the same bytes, so git
stores a grown corpus once) and a `manifest.json` naming the target (name, release, weights hash), each file's
generation settings, its counts (conversations, user turns, assistant tokens) and the sha256 of its data and of its
gzip. `unpack` checks all of that and writes the files back with their records, so `regenerate` resumes them (a
later run grows a file; other settings are refused); `check` verifies without writing. Corrupt or foreign data is
refused in one line: a gzip whose hash differs, a target that is not the one that wrote the corpus, a local file
that is neither a prefix nor an extension of the packed one.

    dspark-hf corpus pack   --data build/smollm2-drafter/data --output examples/smollm2-corpus --target smollm2
    dspark-hf corpus unpack --corpus examples/smollm2-corpus --output build/smollm2-drafter/data --target smollm2
    dspark-hf corpus check  --corpus examples/smollm2-corpus --target smollm2
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
from pathlib import Path

from .files import write_bytes_atomic, write_json_atomic
from .provenance import SETTINGS_SUFFIX, differences, read_settings, write_settings

MANIFEST = "manifest.json"
FORMAT = "dspark-hf corpus 1"


# ---------------------------------------------------------------------------------------------------------- bytes
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _gzip(data: bytes) -> bytes:
    """Deterministic gzip: no file name, no time stamp, so the same data packs to the same bytes."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as packed:
        packed.write(data)
    return buffer.getvalue()


def _counts(data: bytes, tokenizer) -> dict:
    conversations = [json.loads(line) for line in data.splitlines()]
    replies = [m["content"] for c in conversations for m in c["messages"] if m["role"] == "assistant"]
    users = sum(m["role"] == "user" for c in conversations for m in c["messages"])
    tokens = sum(len(ids) for ids in tokenizer(replies, add_special_tokens=False)["input_ids"]) if replies else 0
    return {"conversations": len(conversations), "user_turns": users, "assistant_tokens": tokens}


# ----------------------------------------------------------------------------------------------------------- pack
def regenerated_files(data_dir: Path) -> list[Path]:
    """The regenerated files of `data_dir`: those with a settings record beside them (concatenations have none)."""
    return sorted(p for p in data_dir.glob("*.jsonl") if read_settings(p) is not None)


def _check_written_by(records: dict[str, dict], identity: dict, data_dir: Path) -> None:
    """Every file of one corpus was written by the target it is packed with."""
    for name, settings in records.items():
        changed = differences(settings["target"], identity)
        if changed:
            raise ValueError(f"{data_dir / name} was written by another target ({'; '.join(changed[:2])}); pack it "
                             "with its own --target, or regenerate it with this one")


def pack(data_dir: str | os.PathLike, corpus_dir: str | os.PathLike, target: str, log=print) -> dict:
    """Every regenerated file of `data_dir` into `corpus_dir` (gzips, then the manifest); returns the manifest."""
    from . import __version__
    from .targets import load_target_tokenizer, target_identity

    data_dir, corpus_dir = Path(data_dir), Path(corpus_dir)
    files = regenerated_files(data_dir)
    if not files:
        raise ValueError(f"{data_dir} holds no regenerated file (FILE.jsonl with its FILE.jsonl{SETTINGS_SUFFIX}); "
                         "pass the folder `dspark-hf regenerate --output` wrote to")
    records = {p.name: read_settings(p) for p in files}
    identity = target_identity(target)
    _check_written_by(records, identity, data_dir)
    tokenizer = load_target_tokenizer(target)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    entries = {}
    for path in files:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):  # a regenerate killed mid-line: the whole lines only
            data = data[: data.rfind(b"\n") + 1]
        packed_name = path.name + ".gz"
        packed = _gzip(data)
        if not (corpus_dir / packed_name).is_file() or (corpus_dir / packed_name).read_bytes() != packed:
            write_bytes_atomic(corpus_dir / packed_name, packed)
        settings = {k: v for k, v in records[path.name].items() if k != "target"}
        entries[path.name] = {"packed": packed_name, "settings": settings, **_counts(data, tokenizer),
                              "sha256": _sha256(data), "packed_sha256": _sha256(packed)}
        log(f"corpus: {path.name}: {entries[path.name]['conversations']} conversations, "
            f"{entries[path.name]['assistant_tokens']:,} assistant tokens ({len(packed) / 1e6:.1f} MB packed)")
    for stale in set(p.name for p in corpus_dir.glob("*.jsonl.gz")) - {e["packed"] for e in entries.values()}:
        (corpus_dir / stale).unlink()
    manifest = {"format": FORMAT, "target": identity, "files": entries, "total": _total(entries),
                "packed_by": {"dspark-hf": __version__}}
    write_json_atomic(corpus_dir / MANIFEST, manifest, sort_keys=True)
    log(f"corpus: packed {len(entries)} files into {corpus_dir} ({_summary(manifest)})")
    return manifest


def _total(entries: dict) -> dict:
    return {key: sum(e[key] for e in entries.values()) for key in ("conversations", "user_turns", "assistant_tokens")}


def _summary(manifest: dict) -> str:
    total = manifest["total"]
    return f"{total['conversations']:,} conversations, {total['assistant_tokens']:,} assistant tokens"


# ------------------------------------------------------------------------------------------------ check and unpack
def read_manifest(corpus_dir: str | os.PathLike) -> dict:
    path = Path(corpus_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{corpus_dir} is not a packed corpus (no {MANIFEST}); pass the folder `dspark-hf corpus pack` wrote")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON; restore it (git checkout -- {corpus_dir}) or pack the corpus again") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT!r} manifest (format {manifest.get('format')!r}); pack the corpus again with this version")
    return manifest


def check_target(manifest: dict, target: str, corpus_dir) -> None:
    """The corpus was written by `target`, or one line saying what differs and what to do."""
    from .targets import target_identity

    changed = differences(manifest["target"], target_identity(target))
    if changed:
        raise ValueError(f"the corpus in {corpus_dir} was written by another target than --target {target} "
                         f"({'; '.join(changed[:3])}); install the recorded target, or regenerate the corpus with this one")


def packed_data(corpus_dir: Path, name: str, entry: dict) -> bytes:
    """One file's data, refused where its gzip or its content differs from the manifest (corrupt, or edited)."""
    path = corpus_dir / entry["packed"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the corpus; restore it (git checkout -- {corpus_dir}) or pack the corpus again")
    packed = path.read_bytes()
    if _sha256(packed) != entry["packed_sha256"]:
        raise ValueError(f"{path} is corrupt (its sha256 differs from {MANIFEST}); restore it (git checkout -- {corpus_dir}) or pack the corpus again")
    data = gzip.decompress(packed)
    if _sha256(data) != entry["sha256"]:
        raise ValueError(f"{path} holds other data than {MANIFEST} records for {name}; restore it or pack the corpus again")
    return data


def verified(corpus_dir: str | os.PathLike, target: str | None = None) -> tuple[dict, dict[str, bytes]]:
    """The manifest and every file's data, each whole and matching it (and, with `target`, written by that target)."""
    corpus_dir = Path(corpus_dir)
    manifest = read_manifest(corpus_dir)
    if target is not None:
        check_target(manifest, target, corpus_dir)
    files = {}
    for name, entry in manifest["files"].items():
        files[name] = packed_data(corpus_dir, name, entry)
        lines = files[name].count(b"\n")
        if lines != entry["conversations"]:
            raise ValueError(f"{corpus_dir / entry['packed']} holds {lines} conversations, {MANIFEST} says {entry['conversations']}; pack the corpus again")
    return manifest, files


def check(corpus_dir: str | os.PathLike, target: str | None = None) -> dict:
    """The manifest of a corpus that `verified` accepts."""
    return verified(corpus_dir, target)[0]


def _merge(local: Path, data: bytes, name: str) -> bool:
    """Whether `local` must be (re)written with the packed `data`: missing or a prefix of it; kept where it extends
    it (grown since the pack); refused where the two disagree."""
    if not local.is_file():
        return True
    held = local.read_bytes()
    if held.startswith(data):
        return False
    if data.startswith(held):
        return True
    raise ValueError(f"{local} differs from the packed {name} (neither holds the other's conversations); "
                     "delete it to use the packed one, or pack it to replace the packed one")


def unpack(corpus_dir: str | os.PathLike, data_dir: str | os.PathLike, target: str | None = None, log=print) -> dict:
    """The packed files written back to `data_dir` with their settings records, after `check`."""
    corpus_dir, data_dir = Path(corpus_dir), Path(data_dir)
    manifest, files = verified(corpus_dir, target)
    data_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, entry in manifest["files"].items():
        local, settings = data_dir / name, {**entry["settings"], "target": manifest["target"]}
        recorded = read_settings(local)
        if recorded is not None and local.is_file() and differences(recorded, settings):
            raise ValueError(f"{local} was written with other settings than the packed {name} "
                             f"({'; '.join(differences(recorded, settings)[:3])}); delete it to use the packed one")
        if _merge(local, files[name], name):
            write_bytes_atomic(local, files[name])
            written += 1
        write_settings(local, settings)
    log(f"corpus: {corpus_dir} ({_summary(manifest)}) -> {data_dir}: {written} files written, "
        f"{len(manifest['files']) - written} already there")
    return manifest


# ------------------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .targets import add_target_argument

    parser.description = ("Keep a regenerated corpus in git: pack a folder of regenerated files (with their settings "
                          "records) into gzips and a manifest, check a packed corpus, or unpack it to resume or train.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    packing = actions.add_parser("pack", help="compress every regenerated file of --data into --output with a manifest")
    packing.add_argument("--data", required=True, help="the folder `dspark-hf regenerate --output` files are in")
    packing.add_argument("--output", required=True, help="the corpus directory (gzips and manifest.json)")
    add_target_argument(packing, required=True)
    unpacking = actions.add_parser("unpack", help="check a packed corpus and write its files back to --output")
    unpacking.add_argument("--corpus", required=True, help="a directory `dspark-hf corpus pack` wrote")
    unpacking.add_argument("--output", required=True, help="the folder to write the files to (kept where they extend the packed ones)")
    add_target_argument(unpacking)
    checking = actions.add_parser("check", help="verify a packed corpus (hashes, counts, and with --target its target)")
    checking.add_argument("--corpus", required=True, help="a directory `dspark-hf corpus pack` wrote")
    add_target_argument(checking)
    packing.set_defaults(act=lambda args: pack(args.data, args.output, args.target))
    unpacking.set_defaults(act=lambda args: unpack(args.corpus, args.output, args.target))
    checking.set_defaults(act=_check_command)
    for child in (packing, unpacking, checking):  # `dspark-hf corpus pack --debug` as well as `corpus --debug pack`
        child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _check_command(args: argparse.Namespace) -> None:
    manifest = check(args.corpus, args.target)
    print(f"corpus: {args.corpus} is whole ({len(manifest['files'])} files, {_summary(manifest)})")


def run(args: argparse.Namespace) -> int:
    args.act(args)
    return 0
