"""Models named by a Hugging Face repository id (`path: hf://ORG/NAME[@REVISION]`).

Runs in the gateway process: parsing when the registry loads, and the download itself in a thread,
before the model's first worker starts (gateway.workers.loads). Owns the reference, its folder in
the gateway's model cache (`server.model_cache_dir/ORG--NAME/REVISION`, a plain folder in the
layout engines read), the download through huggingface_hub with progress, and the error an
offline host gets. A folder holds a finished download only once its marker file is written, so an
interrupted download is resumed, never served.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_SCHEME = "hf://"
COMPLETE_MARKER = ".llm-gateway-download-complete"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")

# (files done, files in all, what is being fetched)
Progress = Callable[[int, int, str], None]


class DownloadError(Exception):
    """The model could not be downloaded; str() says why and what to do."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return HUB_SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")

    def folder(self, cache_dir: Path) -> Path:
        return cache_dir / self.repo_id.replace("/", "--") / (self.revision or "main").replace("/", "--")


def parse_hub_path(text: str) -> HubRef:
    """`hf://ORG/NAME` or `hf://ORG/NAME@REVISION` (a branch, tag or commit)."""
    reference = text.removeprefix(HUB_SCHEME)
    repo_id, _, revision = reference.partition("@")
    if not _REPO_ID.match(repo_id):
        raise ValueError(f"{text!r} is not hf://ORG/NAME[@REVISION]")
    if revision and not _REVISION.match(revision):
        raise ValueError(f"{text!r}: {revision!r} is not a revision (a branch, tag or commit)")
    return HubRef(repo_id, revision or None)


def is_downloaded(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _offline_message(ref: HubRef, folder: Path, why: str) -> str:
    return (
        f"cannot download {ref}: {why}, and it is not in the model cache ({folder}). On a host that can "
        f"reach the hub, run `huggingface-cli download {ref.repo_id}"
        + (f" --revision {ref.revision}" if ref.revision else "")
        + f" --local-dir {folder}` and copy the folder here (then `touch {folder / COMPLETE_MARKER}`), "
        "or point `path` at a local folder"
    )


def _progress_class(report: Progress) -> type[Any]:
    """A tqdm class for huggingface_hub that reports its file count instead of drawing a bar."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # Byte bars (unit "B", totals often unknown) are left out: the file count is the progress.
            self.counts_files = kwargs.get("unit", "it") != "B"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = 0
            self.report_total = int(kwargs.get("total") or 0)
            self.what = str(kwargs.get("desc") or "")

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            if self.counts_files:
                report(self.done, self.report_total, self.what)
            return super().update(n)  # type: ignore[no-any-return]

    return Reporting


def download(ref: HubRef, cache_dir: Path, progress: Progress) -> Path:
    """Fetch the repository's files into its cache folder (blocking; run it in a thread)."""
    folder = ref.folder(cache_dir)
    if is_downloaded(folder):
        return folder
    if offline():
        raise DownloadError(_offline_message(ref, folder, "this host is offline (HF_HUB_OFFLINE=1)"))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    folder.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(
            ref.repo_id, revision=ref.revision, local_dir=folder, tqdm_class=_progress_class(progress)
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise DownloadError(f"cannot download {ref}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as exc:
        # No connection (DNS, refused, timeout) reaches us as one of these.
        why = f"the hub is unreachable ({type(exc).__name__})"
        raise DownloadError(_offline_message(ref, folder, why)) from None
    except Exception as exc:  # an HTTP error from the hub (401 on a gated model, 5xx, ...)
        raise DownloadError(f"cannot download {ref}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    (folder / COMPLETE_MARKER).write_text(f"{ref}\n")
    return folder
