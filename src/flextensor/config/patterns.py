"""Pattern syntax and matching for include/exclude patterns (see docs/patterns.md).

Two kinds of pattern:

* a name pattern, a glob over dotted module paths (``layers.*``, ``*.norm``, ``lm_head``);
* a class pattern, ``class:<glob>``, tested against a module's short class name
  (``type(m).__name__``) and its fully qualified name (``f"{cls.__module__}.{cls.__qualname__}"``).

Include and exclude name patterns match differently, on purpose: an include selects modules at one
depth (segment-wise, ``layers.*`` selects ``layers.0`` but not ``layers.0.attn``), while an exclude is a
whole-string glob whose ``*`` spans dots (``*.norm`` removes a norm at any depth).

Pure string logic: no torch. A malformed pattern raises ConfigError (a ValueError).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from flextensor.errors import ConfigError

CLASS_PREFIX = "class:"


def validate_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a well-formed include/exclude pattern, else raise ConfigError.

    Well-formed: a non-empty string without surrounding or inner whitespace; a ``prefix:`` is only allowed
    as ``class:<glob>`` with a non-empty glob.
    """
    if not isinstance(pattern, str):
        raise ConfigError(
            f"pattern {pattern!r} is a {type(pattern).__name__}; patterns are strings such as 'layers.*' "
            "or 'class:LlamaDecoderLayer'"
        )
    if not pattern.strip():
        raise ConfigError("empty pattern; remove it or write a module path such as 'layers.*'")
    if pattern != pattern.strip() or any(c.isspace() for c in pattern):
        raise ConfigError(f"pattern {pattern!r} contains whitespace; module paths never do")
    if ":" in pattern:
        prefix, _, glob = pattern.partition(":")
        if prefix + ":" != CLASS_PREFIX:
            raise ConfigError(
                f"pattern {pattern!r} has an unknown prefix {prefix + ':'!r}; the only prefix is "
                f"'class:' (e.g. 'class:{glob or 'MoELayer'}')"
            )
        if not glob:
            raise ConfigError(f"pattern {pattern!r} names no class; write e.g. 'class:MoELayer'")
    return pattern


def is_class_pattern(pattern: str) -> bool:
    """True for a ``class:<glob>`` pattern, which matches module classes rather than paths."""
    return pattern.startswith(CLASS_PREFIX)


def class_names(cls: type) -> tuple[str, str]:
    """The two names a ``class:`` glob is tested against: short and fully qualified."""
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def match_class(pattern: str, cls: type) -> bool:
    """Whether the ``class:<glob>`` ``pattern`` matches ``cls`` by short or fully qualified name.

    Only ``cls`` itself is tested, not its base classes: ``class:MLP`` does not match a subclass
    ``SharedExpertMLP``, so excluding a base class never silently excludes its specialisations.
    """
    glob = pattern[len(CLASS_PREFIX) :]
    return any(fnmatchcase(name, glob) for name in class_names(cls))


def match_include(pattern: str, path: str, cls: type) -> bool:
    """Whether include ``pattern`` selects the module at ``path`` whose class is ``cls``.

    A name pattern matches segment-wise: same number of dot-separated segments, each matched with
    ``fnmatchcase``; so ``*`` selects only top-level children. The root (``path == ""``) has no name and
    matches no name pattern.
    """
    if is_class_pattern(pattern):
        return match_class(pattern, cls)
    if not path:
        return False
    segments, globs = path.split("."), pattern.split(".")
    return len(segments) == len(globs) and all(
        fnmatchcase(segment, glob) for segment, glob in zip(segments, globs, strict=True)
    )


def match_exclude(pattern: str, path: str, cls: type | None) -> bool:
    """Whether exclude ``pattern`` matches a module (``cls`` its class) or a parameter (``cls`` None).

    A name pattern is a whole-string ``fnmatchcase`` where ``*`` spans dots, so ``*.scale`` matches
    ``layers.0.scale`` but ``*.norm`` does not match a top-level ``norm``. Class patterns never match a
    parameter; name patterns never match the root (``path == ""``).
    """
    if is_class_pattern(pattern):
        return cls is not None and match_class(pattern, cls)
    return bool(path) and fnmatchcase(path, pattern)
