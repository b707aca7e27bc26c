"""The checksum manifest (``megaloop_manifest.json`` in a checkpoint folder): every file's size
and SHA-256, written before the folder is published and verified before it is read, so a file
that is missing, cut short or changed is named instead of failing deep in torch's reader.

Hashing is shared: each rank hashes every world_size-th file (collective), or, for an
asynchronous save, each writer hashes what it wrote and rank 0 adds the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

MANIFEST = "megaloop_manifest.json"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(path: str) -> list:
    """Every file under checkpoint folder ``path`` but the manifest (relative paths, sorted)."""
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_share(path: str, files: list) -> dict:
    """This rank's share of the files (every world_size-th): relpath -> [size, sha256]."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {rel: [os.path.getsize(os.path.join(path, rel)), sha256(os.path.join(path, rel))]
            for rel in files[rank::world]}


def write_manifest(path: str) -> None:
    """Collective: every rank hashes a share of the files; rank 0 writes the manifest."""
    files = checkpoint_files(path)
    shares = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, _hash_share(path, files))
    if torch.distributed.get_rank() == 0:
        _write_file(path, {k: v for share in shares for k, v in share.items()})


def write_manifest_from(path: str, hashed: Optional[dict]) -> None:
    """Rank 0: the manifest from the hashes the async writers took (``hashed``: relpath ->
    [size, sha256]), hashing only the files they did not write (megatron-core's metadata)."""
    if torch.distributed.get_rank() == 0:
        entries = dict(hashed)
        for rel in checkpoint_files(path):
            if rel not in entries:
                full = os.path.join(path, rel)
                entries[rel] = [os.path.getsize(full), sha256(full)]
        _write_file(path, entries)


def _write_file(path: str, entries: dict) -> None:
    manifest = {"format": 1, "algorithm": "sha256",
                "files": {k: {"size": size, "sha256": digest}
                          for k, (size, digest) in sorted(entries.items())}}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(path: str) -> Optional[str]:
    """Collective: every rank checks a share of the manifest's files. Returns None when all
    match (or there is no manifest), else what differs (the same text on every rank)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{manifest_path} is unreadable ({type(exc).__name__}: {exc})"
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    problems = []
    for rel in sorted(files)[rank::world]:
        full, want = os.path.join(path, rel), files[rel]
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != want["size"]:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, the manifest "
                            f"{want['size']} (cut short or overwritten)")
        elif sha256(full) != want["sha256"]:
            problems.append(f"{full} differs from its checksum (corrupted bytes)")
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, problems)
    found = sorted(p for share in gathered for p in share)
    return "; ".join(found) if found else None
