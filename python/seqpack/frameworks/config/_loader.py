"""The shared loader: a recipe read and composed as its framework does, its values
resolved by OmegaConf, and typed access to the keys seqpack reads.

Composition (given a path):

- NeMo-RL's ``defaults:`` inheritance (``nemo_rl.utils.config.load_config_with_inheritance``):
  ``defaults`` is one recipe or a list of them, each relative to the file that names
  it and composed the same way first; the parents merge in order (OmegaConf.merge),
  then the file itself; a top-level section marked ``_override_: true`` replaces the
  parents' section instead of merging into it.
- A Hydra defaults list (verl, ROLL): Hydra's compose API, as the frameworks'
  ``@hydra.main`` launchers compose (``initialize_config_dir`` + ``compose``).

Overrides (``load(..., overrides=[...])``) are Hydra's override grammar: given to
Hydra's ``compose`` for a Hydra recipe, else applied as NeMo-RL's launchers apply
them (``parse_hydra_overrides``: Hydra's override parser, struct mode).
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig, OmegaConf

from ..._lengths import INT64_MAX, as_int
from ._resolve import Resolution, check_depth, check_size, where
from ._types import MAX_DEPTH, ConfigError

TYPO_CUTOFF = 0.8  # difflib ratio at which an unknown key is taken for a misspelled known one
HYDRA_HINT = "install hydra-core (pip install hydra-core, or pip install \"seqpack[hydra]\")"


# ---------------------------------------------------------------- YAML


@functools.lru_cache(maxsize=1)
def _yaml_loader():
    """A safe YAML loader that reads as OmegaConf's does (a duplicate key is an error,
    ``1e-8`` is a float, dates stay strings) and refuses nesting deeper than
    :data:`MAX_DEPTH` while composing (PyYAML's composer recurses once per level)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise ConfigError(f"the config is nested deeper than {MAX_DEPTH} levels "
                                      f"(line {self.peek_event().start_mark.line + 1})")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:str":
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"found duplicate key {key_node.value}", key_node.start_mark)
                    seen.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
        [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
    timestamp = "tag:yaml.org,2002:timestamp"
    Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag != timestamp]
                                      for first, resolvers in Loader.yaml_implicit_resolvers.items()}
    return Loader


def _parse_yaml(text: str, origin: str = "") -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin + ': ' if origin else ''}the YAML does not parse: {exc}") from exc


def _read_file(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return _parse_yaml(f.read(), path)


def looks_like_path(source: Union[str, os.PathLike]) -> bool:
    """A string names a file when it has no line break nor ``": "`` and a path
    separator or a ``.yaml``/``.yml``/``.json`` ending (or names an existing file)."""
    if isinstance(source, os.PathLike):
        return True
    text = str(source)
    if "\n" in text:
        return False
    return (": " not in text and ("/" in text or os.sep in text
                                  or text.strip().lower().endswith((".yaml", ".yml", ".json")))) or os.path.exists(text)


# ---------------------------------------------------------------- composition


def _defaults_kind(value: Any) -> Optional[str]:
    """``"nemo_rl"`` for NeMo-RL's inheritance (a recipe path or a list of them),
    ``"hydra"`` for a Hydra defaults list (config names, ``group: option`` entries,
    ``_self_``), ``None`` without ``defaults``."""
    if value is None:
        return None
    if isinstance(value, str):
        return "nemo_rl"
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, str) and v.strip().lower().endswith((".yaml", ".yml")) for v in value):
        return "nemo_rl"
    return "hydra"


def _create(data: Any, origin: str = "") -> DictConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin + ': ' if origin else ''}the config must be a mapping at the top level, "
                          f"got {type(data).__name__}")
    check_depth(data)
    check_size(data)
    try:
        return OmegaConf.create(data, flags={"allow_objects": True})
    except Exception as exc:  # a key OmegaConf cannot hold (None, ...), a malformed interpolation
        at = f" (at {exc.full_key})" if getattr(exc, "full_key", None) else ""
        raise ConfigError(f"{origin + ': ' if origin else ''}OmegaConf cannot hold this config{at}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _merge_with_override(base: DictConfig, override: DictConfig, origin: str) -> DictConfig:
    """NeMo-RL's ``merge_with_override``: a top-level section of ``override`` marked
    ``_override_: true`` replaces ``base``'s instead of merging into it."""
    for key in list(override.keys()):
        if OmegaConf.is_missing(override, key) or OmegaConf.is_interpolation(override, key):
            continue
        section = override[key]
        if isinstance(section, DictConfig) and section.get("_override_", False) is True:
            section.pop("_override_")
            if key in base:
                base.pop(key)
    try:
        return OmegaConf.merge(base, override)
    except Exception as exc:
        raise ConfigError(f"{origin}: its values do not merge over its parents': "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _compose_nemo_rl(path: str, chain: Tuple[str, ...]) -> DictConfig:
    cfg = _create(_read_file(path), path)
    if "defaults" not in cfg:
        return cfg
    defaults = OmegaConf.to_container(cfg, resolve=False)["defaults"]
    cfg.pop("defaults")
    if _defaults_kind(defaults) != "nemo_rl":
        raise ConfigError(f"{path}: defaults: a parent recipe's path or a list of them, got {defaults!r}")
    base = OmegaConf.create({}, flags={"allow_objects": True})
    for entry in [defaults] if isinstance(defaults, str) else defaults:
        parent = entry if entry.startswith("/") else os.path.join(os.path.dirname(path), entry)
        real = os.path.realpath(parent)
        if real in chain:
            cycle = " -> ".join(os.path.basename(p) for p in chain[chain.index(real):] + (real,))
            raise ConfigError(f"{path}: defaults: {entry!r} inherits from itself ({cycle})")
        if len(chain) >= MAX_DEPTH:
            raise ConfigError(f"{path}: defaults: more than {MAX_DEPTH} levels of inheritance")
        if not os.path.isfile(parent):
            raise ConfigError(f"{path}: defaults: no such parent recipe {entry!r} ({parent})")
        base = _merge_with_override(base, _compose_nemo_rl(parent, chain + (real,)), parent)
    return _merge_with_override(base, cfg, path)


def _hydra_compose(path: str, overrides: Sequence[str], defaults: Any) -> DictConfig:
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from hydra.initialize import get_gh_backup, restore_gh_from_backup
    except ImportError:
        raise ConfigError(f"{path}: defaults: a Hydra defaults list ({defaults!r}) is composed by Hydra; "
                          f"{HYDRA_HINT} to load the recipe by path, or pass the composed config") from None
    directory, name = os.path.split(os.path.abspath(path))
    outer = None
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: compose beside it
        outer = get_gh_backup()
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=directory, version_base=None):
            return compose(config_name=os.path.splitext(name)[0], overrides=list(overrides))
    except Exception as exc:
        raise ConfigError(f"{path}: Hydra does not compose the recipe: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    finally:
        if outer is not None:
            restore_gh_from_backup(outer)


def _apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Apply Hydra-style overrides as NeMo-RL's launchers do
    (``nemo_rl.utils.config.parse_hydra_overrides``): struct mode, so a new key needs
    ``+key=value``."""
    if not overrides:
        return
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser
    except ImportError:
        raise ConfigError(f"overrides: applying Hydra-style overrides needs Hydra's parser; {HYDRA_HINT}") from None
    OmegaConf.set_struct(cfg, True)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
        ConfigLoaderImpl._apply_overrides_to_config(overrides=parsed, cfg=cfg)
    except Exception as exc:
        raise ConfigError(f"overrides: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc
    finally:
        OmegaConf.set_struct(cfg, False)


def check_overrides(overrides: Any) -> List[str]:
    if overrides is None:
        return []
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence) or \
            not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides must be a list of strings such as ['policy.max_total_sequence_length=8192'], "
                          f"got {overrides!r}")
    return list(overrides)


def compose(source: Any, overrides: List[str], notes: List[str]) -> DictConfig:
    """The config ``source`` names, composed as its framework composes it, with
    ``overrides`` applied: an OmegaConf config seqpack owns (a copy)."""
    by_path = isinstance(source, (str, os.PathLike)) and looks_like_path(source)
    if by_path:
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such config file: {path!r}")
        data = _read_file(path)
        defaults = data.get("defaults") if isinstance(data, Mapping) else None
        kind = _defaults_kind(defaults)
        if kind == "hydra":
            return _hydra_compose(path, overrides, defaults)
        cfg = _compose_nemo_rl(path, (os.path.realpath(path),)) if kind == "nemo_rl" else _create(data, path)
    elif isinstance(source, DictConfig):
        cfg = copy.deepcopy(source)
        check_depth(OmegaConf.to_container(cfg, resolve=False))
    elif isinstance(source, (str, os.PathLike)):
        cfg = _create(_parse_yaml(os.fspath(source)))
    else:
        cfg = _create(source)
    if not by_path and "defaults" in cfg:
        notes.append("defaults: not composed: a recipe's parents are composed when it is given by path "
                     "(load('recipe.yaml')); given as text or a mapping it is read alone")
    _apply_overrides(cfg, overrides)
    return cfg


# ---------------------------------------------------------------- reading values


def did_you_mean(key: Any, options, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(str(key), [str(o) for o in options], n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


class Context:
    """What one load shares: the values, resolved as they are read, and the warnings
    it gives."""

    def __init__(self, resolution: Resolution):
        self.res = resolution
        self.notes: List[str] = []

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def value(self, keys: Tuple[Any, ...]) -> Any:
        """The value at ``keys`` (a key of a section already read), resolved: it must
        resolve, and must not be ``???``."""
        value = self.res.value(keys)
        failure = self.res.failures.get(keys)
        if failure is not None:
            raise ConfigError(failure.message(keys))
        if isinstance(value, str) and value == "???":
            raise ConfigError(f"{where(keys)}: is '???', a value the recipe leaves to its launcher's command line; "
                              f"give it (load(..., overrides=['{where(keys)}=...']))")
        return value

    def get(self, keys: Tuple[Any, ...], default: Any = None) -> Any:
        """:meth:`value`, or ``default`` where the section read holds no such key."""
        parent = self.res.at(keys[:-1])
        if not isinstance(parent, Mapping) or keys[-1] not in parent:
            return default
        return self.value(keys)


class Reader:
    """Typed access to a section of the resolved config that names the key path in
    every error. ``lenient``: the section is switched off; a value that breaks its
    rule is then a warning, and its default is used."""

    def __init__(self, ctx: Context, keys: Tuple[Any, ...], data: Any, lenient: Optional[str] = None):
        self.path = where(keys) if keys else ""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{self.path}: must be a mapping, got {type(data).__name__}")
        self.ctx, self.keys, self.data, self.lenient = ctx, keys, data, lenient

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def section(self, name: str) -> "Reader":
        value = self.get(name)
        return Reader(self.ctx, self.keys + (name,), {} if value is None else value, self.lenient)

    def relaxed(self, reason: str) -> "Reader":
        return Reader(self.ctx, self.keys, self.data, reason)

    def known(self, read, framework=(), owner: str = "the framework") -> "Reader":
        """A section seqpack reads: a key close to a known one is a typo (an error
        with a did-you-mean); another unknown key belongs to the framework (a
        warning: seqpack ignores it)."""
        known = tuple(read) + tuple(framework)
        for key in self.data:
            if key in known:
                continue
            close = did_you_mean(key, known, cutoff=TYPO_CUTOFF)
            if close:
                raise ConfigError(f"{self.key(key)}: unknown key{close} (known: {', '.join(sorted(known))})")
            self.ctx.note(f"{self.key(key)}: not a key seqpack reads; left to {owner}")
        return self

    def no_lookalike(self, sections, *, what: str = "section", known=()) -> "Reader":
        """A key close to, but not, one of ``sections`` is a misspelled section (which
        would otherwise silently turn its feature off). ``known``: the framework's
        own keys that are close to one (not typos)."""
        for key in self.data:
            if key not in sections and key not in known and did_you_mean(key, sections, cutoff=0.85):
                raise ConfigError(f"{self.key(key)}: unknown {what}{did_you_mean(key, sections, cutoff=0.85)}")
        return self

    def _typed(self, name: str, default: Any, convert) -> Any:
        if self.lenient is None:
            return convert()
        try:
            return convert()
        except ConfigError as exc:
            self.ctx.note(f"{exc}; ignored while {self.lenient}")
            return default

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` resolved (``default`` when the section has no such key)."""
        if name not in self.data:
            return default
        return self.ctx.value(self.keys + (name,))

    def text(self, name: str, default: str) -> str:
        def convert():
            value = self.get(name, default)
            if value is None:
                return default
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{self.key(name)}: must be a non-empty string, got {value!r}")
            return value.strip()
        return self._typed(name, default, convert)

    def bool(self, name: str, default: bool = False) -> bool:
        def convert():
            value = self.get(name, default)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise ConfigError(f"{self.key(name)}: must be true or false, got {value!r}")
            return value
        return self._typed(name, default, convert)

    def int(self, name: str, default: Optional[int] = None, minimum: int = 1) -> Optional[int]:
        def convert():
            value = self.get(name, default)
            if value is None:
                return None
            try:
                value = as_int(value, self.key(name))  # NumPy and 0-d tensor integers too
            except TypeError:
                raise ConfigError(f"{self.key(name)}: must be an integer, got {value!r}") from None
            if value < minimum:
                raise ConfigError(f"{self.key(name)}: must be >= {minimum}, got {value}")
            if value > INT64_MAX:
                raise ConfigError(f"{self.key(name)}: must fit in int64 (<= {INT64_MAX}), got {value}")
            return value
        return self._typed(name, default, convert)

    def need(self, name: str, default: int) -> int:
        """An integer >= 1 that may be left out (``default``) but not set to null."""
        if name in self.data and self.get(name) is None:
            raise ConfigError(f"{self.key(name)}: must be an integer, got None")
        return self.int(name, default)

    def choice(self, name: str, options, default: str) -> str:
        def convert():
            value = self.get(name, default)
            if value is None:
                return default
            if not isinstance(value, str) or value.strip().lower() not in options:
                raise ConfigError(f"{self.key(name)}: must be one of {list(options)}, got {value!r}")
            return value.strip().lower()
        return self._typed(name, default, convert)

