"""The Hugging Face hub, for models (gspo.models) and datasets (gspo.tasks.datasets): telling a
hub id from a local path, and finding out at once when the hub cannot be reached, so that a
run fails with one line instead of after the libraries' retries with back-off (40 s and more).
"""

from __future__ import annotations

import os
import re
import socket

# "name" or "org/name": letters, digits, '-', '_', '.' (the hub's own rule, less its length cap)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")


def looks_like_path(name: str) -> bool:
    """A hub id is "name" or "org/name", so one "/" alone does not make a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` can be a hub repository id; a name ending in a data file's suffix is taken
    for a missing file (a hub id may hold dots, but 'train.jsonl' is never meant as one)."""
    return (not looks_like_path(name) and _HUB_ID.fullmatch(name) is not None
            and not name.lower().endswith(DATA_SUFFIXES))


def in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a model repository's config.json (so that a hub id
    loads offline)."""
    return cached_snapshot(repo_id) is not None


def cached_snapshot(repo_id: str) -> str | None:
    """The directory of the cached copy of a hub model repository (the snapshot holding its
    config.json), or None when the cache has none."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, "config.json")
    except (ImportError, ValueError):  # ValueError: not a valid repo id
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be used from here (offline mode, no route), or None when it answers."""
    from urllib.parse import urlparse

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"the hub at {constants.ENDPOINT} cannot be reached from here ({e.strerror or e})"
    return None
