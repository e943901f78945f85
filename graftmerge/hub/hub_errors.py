"""huggingface_hub's exceptions during a push or pull, as one GraftError line that says what to do.

:class:`HubArtifactNotFound` (no such repo, or offline and not cached: maybe a local path
was meant) and :class:`NotThisKind` (the repo is there but holds another kind) are
GraftErrors a caller can tell apart: ``graftmerge delta pull`` then asks the next kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx2
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from graftmerge.errors import GraftError
from graftmerge.hub.artifact_kind import ArtifactKind
from graftmerge.hub.references import HubReference


class HubArtifactNotFound(GraftError):
    """The Hub has no such repo, or (offline) the local cache has no copy: maybe a local path was meant."""


class NotThisKind(GraftError):
    """The repo exists but has no manifest of this kind: it may be another kind (:func:`~graftmerge.hub.pull.pull_first_kind`)."""


@contextmanager
def hub_errors(kind: ArtifactKind, reference: HubReference, action: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line GraftErrors that say what to do."""
    try:
        yield
    except GatedRepoError as error:
        raise GraftError(
            f"{reference.repo_id} is gated: accept its terms on the Hub, then pass --token or log in (`hf auth login`)"
        ) from error
    except RepositoryNotFoundError as error:
        raise HubArtifactNotFound(
            f"no Hub repo {reference.repo_id} (or it is private: pass --token or log in with `hf auth login`)"
        ) from error
    except RevisionNotFoundError as error:
        raise GraftError(
            f"revision {reference.revision_or_main!r} does not exist in Hub repo {reference.repo_id}"
        ) from error
    except RemoteEntryNotFoundError as error:
        response = getattr(error, "response", None)
        missing = str(response.url).rsplit("/", 1)[-1] if response is not None else kind.manifest_name
        if missing == kind.manifest_name:
            raise NotThisKind(f"{reference} is not a {kind.noun} (the repo has no {missing})") from error
        raise GraftError(f"{reference} is not a {kind.noun} (the repo has no {missing}{kind.missing_hint})") from error
    except OfflineModeIsEnabled as error:
        raise HubArtifactNotFound(
            f"cannot {action} {reference}: the Hub is offline (HF_HUB_OFFLINE=1) and it is not in the local "
            f"Hugging Face cache; run `graftmerge {kind.name} pull {reference}` where the Hub is reachable"
        ) from error
    except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError, LocalEntryNotFoundError) as error:
        raise GraftError(
            f"cannot {action} {reference}: the Hub did not answer ({type(error).__name__}); "
            "run the same command again, it resumes where it stopped"
        ) from error
    except HfHubHTTPError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise GraftError(f"cannot {action} {reference}: {first}; run the same command again to resume") from error
