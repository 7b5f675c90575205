"""One profile file for a whole pipeline: the profile of each offloaded component, under its name.

[Note: pipeline profile format]
A pipeline's file wraps one model profile (profiles/file.py's format, validated the same way) per
component::

    {"format": "flextensor-pipeline-profile", "version": 1, "flextensor_version": ..., "created_at": ...,
     "components": {"text_encoder": {<a model profile>}, "transformer": {...}, ...}}

Reloaded, it must name exactly the pipeline's offloaded components: a component added or missing means
another pipeline (or other patterns), and planning some components from the file and learning the others
would silently mix two setups, so it is an error that says to delete the file and re-profile. Each
component's profile is then checked against that component as a model's would be (another model raises,
another device or torch re-plans with a warning).

Pure: no torch.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

from flextensor.errors import ProfileError
from flextensor.profiles.file import (
    PIPELINE_PROFILE_FORMAT,
    PROFILE_VERSION,
    Profile,
    profile_from_dict,
    profile_to_dict,
    read_profile_json,
    write_profile_json,
)

__all__ = ["is_pipeline_profile", "load_pipeline_profile", "read_pipeline_profile", "save_pipeline_profile"]

_REPROFILE = "delete it to re-profile the pipeline"


def save_pipeline_profile(
    profiles: Mapping[str, Profile], path: str | os.PathLike[str], flextensor_version: str
) -> None:
    """Write the components' ``profiles`` to ``path`` atomically, each validated as it would be loaded."""
    path = os.fspath(path)
    components = {}
    for name, profile in profiles.items():
        data = profile_to_dict(profile)
        profile_from_dict(data, source=f"{path} (being saved), component {name!r}")
        components[name] = data
    write_profile_json(
        {
            "format": PIPELINE_PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "flextensor_version": flextensor_version,
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "components": components,
        },
        path,
    )


def load_pipeline_profile(path: str | os.PathLike[str], components: set[str]) -> dict[str, Profile]:
    """The profile of each of ``components`` from the pipeline profile at ``path``; ProfileError naming
    the file for anything else (a model's profile, another set of components, a bad component entry)."""
    path = os.fspath(path)
    profiles = read_pipeline_profile(path, read_profile_json(path))
    if set(profiles) != components:
        raise ProfileError(
            f"profile {path} was saved for the components {sorted(profiles)}, but this pipeline offloads "
            f"{sorted(components)}: it belongs to another pipeline or other patterns; {_REPROFILE}"
        )
    return profiles


def is_pipeline_profile(data: Any) -> bool:
    """Whether parsed profile JSON is a whole pipeline's (see [Note: pipeline profile format])."""
    return isinstance(data, dict) and data.get("format") == PIPELINE_PROFILE_FORMAT


def read_pipeline_profile(path: str, data: Any) -> dict[str, Profile]:
    """Every component's profile from ``data``, the parsed JSON of the pipeline profile at ``path``
    (``flextensor profile show`` and ``plan`` read one without its pipeline)."""
    if not is_pipeline_profile(data):
        what = "one model's profile" if isinstance(data, dict) and "fingerprint" in data else "not one"
        raise ProfileError(
            f"profile {path} is not a pipeline's profile ({what}); a pipeline reloads the file that "
            "flextensor.save_profile(pipe, path) wrote; give a model's profile to that model's offload"
        )
    version = data.get("version")
    if version != PROFILE_VERSION:
        raise ProfileError(
            f"profile {path} has version {version!r}; this flextensor reads version {PROFILE_VERSION}; "
            f"{_REPROFILE}"
        )
    unknown = set(data) - {"format", "version", "flextensor_version", "created_at", "components"}
    if unknown:
        raise ProfileError(f"profile {path} has unknown keys {sorted(unknown)}; {_REPROFILE}")
    saved: Any = data.get("components")
    if not isinstance(saved, dict):
        raise ProfileError(f"profile {path} has no 'components' object; {_REPROFILE}")
    return {
        name: profile_from_dict(entry, source=f"{path}, component {name!r}") for name, entry in saved.items()
    }
