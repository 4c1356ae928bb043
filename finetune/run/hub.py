"""A hub model id, checked before launch (issue 34: `Meta-Llama-3-8B-Instuct` passed preflight, then 47-50 s of
download retries ended in "cannot write the run directory" and an empty run directory; with no hub access a correct
id failed the same way).

Not in the local Hugging Face cache: one `model_info` request (a few hundred bytes, TIMEOUT seconds at most) says
whether the Hub has it. Offline (HF_HUB_OFFLINE, or no answer) it is refused with one line saying so. A name the
Hub does not know gets a did-you-mean from the planner's table of real ids (finetune.plan.archs.HUB_IDS).
FINETUNE_HUB_CHECK=0 skips the request (the launch then downloads as before): a launcher without network whose
ranks have it, or the test suite, which never touches the network.
"""

from __future__ import annotations

import os
from typing import Optional

from finetune.suggest import NEAR, closest

TIMEOUT = 10.0  # seconds: an answer from the Hub takes well under one; the download retries took 47-50 s
CHECK_ENV = "FINETUNE_HUB_CHECK"
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants._is_true


def hub_model_problem(repo_id: str, revision: Optional[str]) -> tuple[Optional[str], str]:
    """(problem, note): problem is the one line that stops the launch, else None and a note on where it is."""
    if _cached(repo_id, revision):
        return None, "a hub id, found in the local Hugging Face cache"
    if os.environ.get(CHECK_ENV, "1").strip().upper() in {"0", "OFF", "NO", "FALSE"}:
        return None, (f"a hub id, not in the local cache: it will be downloaded at launch ({CHECK_ENV}=0: "
                      "not looked up; needs network, and HF_TOKEN for gated models)")
    guess = did_you_mean(repo_id)
    hint = f"; did you mean {guess}?" if guess else ""
    if _offline():
        return (f"not in the local Hugging Face cache, and HF_HUB_OFFLINE is set: offline, it cannot be downloaded"
                f"{hint} (download it where there is network, or give a local directory)"), ""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=TIMEOUT)
    except HFValidationError as exc:
        return f"not a hub id or a local directory ({_first_line(exc)}){hint}", ""
    except RevisionNotFoundError:
        return f"the Hugging Face Hub has no revision {revision!r} of it", ""
    except GatedRepoError:
        return "a gated model: accept its licence on huggingface.co and set HF_TOKEN", ""
    except RepositoryNotFoundError:
        return f"not found on the Hugging Face Hub (a private one needs HF_TOKEN){hint}", ""
    except HfHubHTTPError as exc:
        return f"the Hugging Face Hub answered: {_first_line(exc)}", ""
    except Exception as exc:  # no network: DNS, connection, timeout (httpx's errors, whichever httpx it uses)
        return (f"not in the local Hugging Face cache, and the Hub cannot be reached: offline? "
                f"({type(exc).__name__}: {_first_line(exc)}){hint}; download it where there is network, or give a "
                "local directory"), ""
    gated = " (gated: the download needs HF_TOKEN with access)" if getattr(info, "gated", False) else ""
    return None, f"a hub id on the Hugging Face Hub, not in the local cache: downloaded at launch{gated}"


def did_you_mean(repo_id: str) -> Optional[str]:
    """The known hub id closest to `repo_id` (case-insensitive), when it is a near miss and not the same."""
    from finetune.plan.archs import HUB_IDS
    from finetune.vision_models import published_hub_ids

    known = {i.lower(): i for ids in HUB_IDS.values() for i in ids} | {i.lower(): i for i in published_hub_ids()}
    if repo_id.lower() in known:
        return known[repo_id.lower()] if known[repo_id.lower()] != repo_id else None
    close = closest(repo_id.lower(), known, cutoff=NEAR)
    return known[close] if close else None


def _cached(repo_id: str, revision: Optional[str]) -> bool:
    from finetune.recipe.references import MODEL_CONFIG

    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, MODEL_CONFIG, revision=revision), str)
    except Exception:  # not a valid repo id, or huggingface_hub missing: the look-up will tell
        return False


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or \
        (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]
