"""`finetune publish RUN_OR_EXPORT --repo USER/NAME`: the files and the card into one commit of a Hub repository.

huggingface_hub does the work as its authors intend: `create_repo(exist_ok=True)`, then one `create_commit` with a
CommitOperationAdd per file (what `upload_folder` does after listing a folder; here the list is finetune's allow-list,
so no staging copy of the weights is made). The endpoint is HF_ENDPOINT when it is set (huggingface_hub reads it
once, at import; finetune reads it when it publishes). Before anything is sent, every text file and the card are
searched for this machine's paths and for the token: a match stops the upload.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from finetune.publish.contents import CARD_FILE, Item, Publication, PublishError, collect

# Files whose text is searched before upload (weights and vocabularies are not text a path could hide in).
_SEARCHED = (".json", ".jinja", ".yaml", ".md", ".txt")
_VOCABULARIES = ("tokenizer.json", "vocab.json", "merges.txt")  # tokens such as "/root" are words, not paths
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
NO_TOKEN = ("no Hugging Face token: set HF_TOKEN or run `hf auth login` (huggingface_hub's CLI); "
            "--dry-run shows what would be uploaded without one")


@dataclass
class PublishResult:
    publication: Publication
    repo_id: str
    card: str
    url: Optional[str] = None      # the commit, when something was sent
    dry_run: bool = False

    def listing(self) -> list[str]:
        from finetune.units import human_size

        width = max(len(i.path) for i in self.publication.items)
        return [f"  {i.path.ljust(width)}  {human_size(i.size):>9}  "
                f"{'written by finetune' if isinstance(i.source, bytes) else 'from ' + _shown(i.source)}"
                for i in self.publication.items]


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def check_repo_id(repo_id: str) -> str:
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise PublishError(f"--repo {repo_id!r}: expected USER/NAME (letters, digits, - _ .)", exit_code=2)
    return repo_id


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def publish(path: Path, repo_id: str, *, private: bool = False, dry_run: bool = False,
            log: Callable[[str], None] = lambda s: None) -> PublishResult:
    """Collect, write the card, check every byte that is text, then create the repository and commit (dry run:
    stop before the network)."""
    from finetune.publish.card import card_text

    check_repo_id(repo_id)
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise PublishError("publish needs huggingface_hub, which is not installed: pip install 'finetune[publish]'") from None
    token = None if dry_run else _token()
    pub = collect(path)
    card = card_text(pub, repo_id)
    pub.items.append(Item(CARD_FILE, card.encode()))
    _check_leaks(pub, token)
    result = PublishResult(pub, repo_id, card, dry_run=dry_run)
    if dry_run:
        return result
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint(), token=token)
    operations = [CommitOperationAdd(path_in_repo=i.path, path_or_fileobj=i.source if isinstance(i.source, bytes)
                                     else str(i.source)) for i in pub.items]
    try:
        log(f"creating {repo_id} on {endpoint()} ({'private' if private else 'public'}, unless it exists) ...")
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        log(f"uploading {len(operations)} files ...")
        info = api.create_commit(repo_id, operations=operations, repo_type="model",
                                 commit_message=f"finetune publish: {pub.name} ({pub.kind})")
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no response"
        raise PublishError(f"{endpoint()} refused the upload to {repo_id} (HTTP {status}): "
                           f"{' '.join(str(exc).split())[:300]}") from None
    except (OSError, ConnectionError) as exc:
        raise PublishError(f"cannot reach {endpoint()}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    result.url = str(info.commit_url)
    return result


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PublishError(NO_TOKEN)
    return token


def _check_leaks(pub: Publication, token: Optional[str]) -> None:
    from finetune.publish.scrub import leaks

    folder = str(pub.folder.resolve())
    problems = []
    for item in pub.items:
        if (not item.path.endswith(_SEARCHED) and item.path != "Modelfile") or item.path in _VOCABULARIES:
            continue
        for what in leaks(item.data(), token, [folder]):
            problems.append(f"{item.path} holds {what}")
    if problems:
        raise PublishError("nothing was uploaded: " + "; ".join(problems) + " (remove it from the file, or "
                           "report it if finetune wrote it)")
