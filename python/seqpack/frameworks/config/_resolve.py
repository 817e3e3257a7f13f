"""Interpolations resolved by OmegaConf on demand: only the values seqpack reads, each
after the values it refers to.

Nothing is resolved when a config is loaded: :meth:`Resolution.value` resolves one
path when seqpack reads it, with the chain of values it refers to. OmegaConf follows
a chain of references recursively and does not remember what it resolved, so a chain
of a few hundred links runs out of Python's recursion limit; :meth:`Resolution.resolve`
asks OmegaConf for one link at a time, in an order where the values a link refers to
are already resolved and written back as constants: OmegaConf's recursion stays one
link deep whatever the chain. The references of a value are read with OmegaConf's own
grammar (``omegaconf.grammar_parser``); they only decide the order: OmegaConf resolves
each value, and follows itself any reference this order misses.

A value that does not resolve is recorded with its reason (:class:`Failure`): an
error where seqpack reads it. A value seqpack does not read is never resolved: its
resolvers never run, and it stays as written.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, grammar_parser
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as _Grammar

from ._types import MAX_DEPTH, ConfigError

INTERPOLATION_BUDGET = 100_000  # values a config may hold: YAML aliases and copied sections included

Path = Tuple[Any, ...]
_KEY_PART = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")
_SIMPLE_REFERENCE = re.compile(r"\$\{(\.*[A-Za-z_][\w\-]*(?:\.[A-Za-z_][\w\-]*)*)\}")


def where(path: Path) -> str:
    """``a.b.0`` for the path ``("a", "b", 0)``."""
    return ".".join(str(p) for p in path) or "the config"


class Failure:
    """Why the value at a path does not resolve: OmegaConf's error, the value as
    written and the chain of values that led to the error."""

    __slots__ = ("error", "text", "chain")

    def __init__(self, error: BaseException, text: str, chain: List[Path]):
        self.error, self.text, self.chain = error, text, chain

    def reason(self) -> str:
        if isinstance(self.error, RecursionError):
            return "RecursionError: the interpolations refer to each other too deeply for OmegaConf"
        first = str(self.error).strip().splitlines()
        return f"{type(self.error).__name__}: {first[0] if first else ''}".rstrip(": ")

    def message(self, path: Path) -> str:
        chain = [path] + [p for p in self.chain[1:] if p != path]
        full_key = getattr(self.error, "full_key", None)
        if full_key and full_key not in [where(p) for p in chain]:
            chain_text = " -> ".join([where(p) for p in chain] + [str(full_key)])
        else:
            chain_text = " -> ".join(where(p) for p in chain)
        return (f"{where(path)}: the interpolation {self.text!r} does not resolve "
                f"(chain: {chain_text}): {self.reason()}")


# NeMo-RL's resolvers (nemo_rl.utils.config.register_omegaconf_resolvers), registered
# for the time of a load when nothing else has registered these names.
def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _mul(a, b):
    return a * b


def _div(a, b):
    return a / b


def _max(a, b):
    return max(a, b)


NEMO_RL_RESOLVERS = {"add": _add, "sub": _sub, "mul": _mul, "div": _div, "max": _max}


def register_resolvers() -> List[str]:
    """Register the resolvers of :data:`NEMO_RL_RESOLVERS` that are not registered yet
    and return their names (:func:`unregister` removes them). OmegaConf 2.4 names the
    call ``register_resolver`` and deprecates ``register_new_resolver``; 2.3's
    ``register_resolver`` is the deprecated legacy one."""
    register = OmegaConf.register_resolver
    if "use_cache" not in inspect.signature(register).parameters:  # OmegaConf < 2.4
        register = OmegaConf.register_new_resolver
    added = []
    for name, fn in NEMO_RL_RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            register(name, fn)
            added.append(name)
    return added


def unregister(names: List[str]) -> None:
    for name in names:
        OmegaConf.clear_resolver(name)


def _references(text: str) -> Iterator[str]:
    """The keys ``text`` refers to, read with OmegaConf's grammar: node
    interpolations (``${a.b}``, ``${..a}``) and the key of ``${oc.select:key,...}``;
    a key that is itself computed (``${${k}}``) is left to OmegaConf."""
    simple = _SIMPLE_REFERENCE.fullmatch(text)
    if simple:  # ``${a.b}`` / ``${..a}`` alone: what the grammar would give, without running it
        yield simple.group(1)
        return
    try:
        tree = grammar_parser.parse(text)
    except Exception:  # OmegaConf reports the grammar error when it resolves the value
        return
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _Grammar.InterpolationNodeContext):
            inner = node.getText()[2:-1]
            if "${" not in inner:
                yield inner
        elif isinstance(node, _Grammar.InterpolationResolverContext):
            name, args = node.resolverName(), node.sequence()
            if name is not None and name.getText() == "oc.select" and args is not None and args.element():
                key = args.element(0).getText().strip()
                if key and "${" not in key:
                    yield key
        count = node.getChildCount() if hasattr(node, "getChildCount") else 0
        stack.extend(node.getChild(i) for i in range(count - 1, -1, -1))


class Resolution:
    """The values of ``cfg`` (an OmegaConf config seqpack owns: it is written to),
    resolved when read. :attr:`plain` holds the config in plain containers, as
    written until a value is read through :meth:`value` (then resolved in place);
    :attr:`failures` says why each value read that does not resolve does not."""

    def __init__(self, cfg: DictConfig, plain: Any):
        OmegaConf.set_readonly(cfg, False)
        self.cfg = cfg
        self.plain: Any = plain
        self.text: Dict[Path, str] = {}  # the interpolations as written
        stack: list = [((), self.plain)]
        while stack:
            path, node = stack.pop()
            if isinstance(node, str):
                if "${" in node:
                    self.text[path] = node
            elif isinstance(node, (Mapping, list)):
                items = list(node.items() if isinstance(node, Mapping) else enumerate(node))
                stack.extend((path + (k,), v) for k, v in reversed(items))
        self.failures: Dict[Path, Failure] = {}
        self.done: Set[Path] = set()
        self.produced = 0

    # ------------------------------------------------------------ navigation
    def at(self, path: Path) -> Any:
        node = self.plain
        for key in path:
            node = node[key]
        return node

    def _put(self, path: Path, value: Any) -> None:
        self.at(path[:-1])[path[-1]] = value

    def _step(self, node: Any, part: str) -> Tuple[bool, Any]:
        if isinstance(node, list):
            try:
                index = int(part)
                node[index]
                return True, index
            except (ValueError, IndexError):
                return False, None
        if isinstance(node, Mapping):
            if part in node:
                return True, part
            try:
                if int(part) in node:
                    return True, int(part)
            except ValueError:
                pass
        return False, None

    def _target(self, path: Path, key: str) -> Optional[Path]:
        """The path ``key`` names, seen from the value at ``path`` (``None`` when it
        names nothing, or a section not resolved yet that seqpack leaves to OmegaConf)."""
        dots = len(key) - len(key.lstrip("."))
        rest = key[dots:]
        base: Path = ()
        if dots:
            base = path[:-1]
            if dots - 1 > len(base):
                return None
            base = base[:len(base) - (dots - 1)]
        node, out = self.at(base), base
        for bracket, plain in _KEY_PART.findall(rest):
            if isinstance(node, str) and out in self.text:
                return out  # a section given by an interpolation: it goes first
            found, step = self._step(node, bracket or plain)
            if not found:
                return None
            node, out = node[step], out + (step,)
        return out

    def _dependencies(self, path: Path) -> List[Path]:
        """The interpolations the value at ``path`` refers to (not the values inside a
        section it refers to: those are resolved when read)."""
        deps: List[Path] = []
        for key in _references(self.text[path]):
            target = self._target(path, key)
            if target is not None and target in self.text:
                deps.append(target)
        return deps

    # ------------------------------------------------------------ resolution
    def value(self, path: Path) -> Any:
        """The value at ``path`` (which exists in :attr:`plain`; its parent has been
        read), resolved with what it refers to. A value that does not resolve is
        recorded in :attr:`failures` and stays as written."""
        if path in self.text and path not in self.done:
            self.resolve(path)
        return self.at(path)

    def resolve(self, start: Path) -> None:
        """Resolve ``start`` after what it refers to (depth first, with an explicit
        stack: no recursion however long the chain). A reference back to a value
        still waiting on the stack is a cycle: OmegaConf reports it."""
        stack = [(start, False)]
        waiting: Set[Path] = set()
        while stack:
            path, expanded = stack.pop()
            if path in self.done:
                continue
            if expanded:
                waiting.discard(path)
                self._one(path)
                self.done.add(path)
                continue
            if path in waiting:
                continue
            waiting.add(path)
            stack.append((path, True))
            stack.extend((dep, False) for dep in reversed(self._dependencies(path))
                         if dep not in self.done and dep not in waiting)

    def _one(self, path: Path) -> None:
        try:
            node = self.cfg
            for key in path[:-1]:
                node = node[key]
            value = node[path[-1]]
        except ConfigError:
            raise
        except (Exception, RecursionError) as exc:  # OmegaConf's errors, and a resolver's
            chain = [path]
            for dep in self._dependencies(path):
                if dep in self.failures:
                    chain += self.failures[dep].chain
                    break
            self.failures[path] = Failure(exc, self.text[path], chain)
            return
        if isinstance(value, (DictConfig, ListConfig)):
            self._put(path, self._section(path, value))
            return
        if isinstance(value, (Mapping, list, tuple)):  # a resolver's own container (allow_objects)
            self._produce(path, value)
        self._put(path, value)
        if not (isinstance(value, str) and ("${" in value or value == "???")):  # stays literal in OmegaConf
            try:
                node[path[-1]] = value  # a constant now: what refers to it resolves in one step
            except Exception:
                pass

    def _produce(self, path: Path, section: Any) -> None:
        """A section a read value gives: within the budget, and the nesting bound."""
        check_depth(section, where(path))
        self.produced += _count(section)
        if self.produced > INTERPOLATION_BUDGET:
            raise ConfigError(f"{where(path)}: the config's interpolations expand to more than "
                              f"{INTERPOLATION_BUDGET} values (sections copied into sections)")

    def _section(self, path: Path, value: Any) -> Any:
        """A section an interpolation gives, as plain values: a copy of the section
        where the interpolation names one, else OmegaConf's values, both as they
        stand. The interpolations inside are resolved when read (through ``path``:
        OmegaConf resolves them where the section lives)."""
        text = self.text[path]
        refs = list(_references(text)) if text.startswith("${") and text.endswith("}") else []
        target = self._target(path, refs[0]) if len(refs) == 1 and text == "${" + refs[0] + "}" else None
        if target is not None and not isinstance(self.at(target), (Mapping, list)):
            target = None  # not resolved here: OmegaConf's values
        try:
            copied = _copy(self.at(target)) if target is not None else OmegaConf.to_container(value, resolve=False)
        except RecursionError:
            raise ConfigError(f"{where(path)}: the section it gives is nested deeper than {MAX_DEPTH} levels") from None
        self._produce(path, copied)
        stack: list = [((), copied)]
        while stack:  # what is inside: resolved when read, or as resolved in the section copied
            sub, node = stack.pop()
            source = None if target is None else target + sub
            if sub and source is not None and source in self.done:
                self.done.add(path + sub)
                if source in self.failures:
                    self.failures[path + sub] = self.failures[source]
            elif isinstance(node, str):
                if "${" in node and sub:
                    self.text[path + sub] = self.text.get(source, node) if source is not None else node
                continue
            if isinstance(node, (Mapping, list)):
                items = node.items() if isinstance(node, Mapping) else enumerate(node)
                stack.extend((sub + (k,), v) for k, v in items)
        return copied


def _copy(node: Any) -> Any:
    """A copy of plain containers, iterative (no recursion on a deep section)."""
    if not isinstance(node, (Mapping, list)):
        return node
    root: Any = {} if isinstance(node, Mapping) else []
    stack = [(node, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, Mapping) else enumerate(source)
        for key, value in items:
            child = {} if isinstance(value, Mapping) else [] if isinstance(value, list) else value
            if isinstance(target, dict):
                target[key] = child
            else:
                target.append(child)
            if child is not value:
                stack.append((value, child))
    return root


def _count(node: Any) -> int:
    """The values in ``node`` (counted up to just past :data:`INTERPOLATION_BUDGET`:
    a section shared through references is counted each time it appears)."""
    total, stack = 0, [node]
    while stack and total <= INTERPOLATION_BUDGET:
        item = stack.pop()
        total += 1
        if isinstance(item, (Mapping, list, tuple)):
            stack.extend(item.values() if isinstance(item, Mapping) else item)
    return total


def check_depth(data: Any, at: str = "") -> None:
    """Refuse containers nested deeper than :data:`MAX_DEPTH` (OmegaConf, ``==`` and
    ``repr`` recurse, and would raise ``RecursionError``). Iterative; a container is
    expanded again only when reached deeper than before, so nodes shared through
    YAML aliases cost at most ``MAX_DEPTH`` visits, and a self-referencing one counts
    as too deep."""
    best: Dict[int, int] = {}
    stack: list = [(data, 1, None)]  # (node, depth, (key, parent's link) or None at the top)
    while stack:
        node, depth, link = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)) or best.get(id(node), 0) >= depth:
            continue
        if depth > MAX_DEPTH:
            keys = []
            while link is not None:
                keys.append(str(link[0]))
                link = link[1]
            shown = ".".join(([at] if at else []) + list(reversed(keys)))
            shown = shown if len(shown) <= 120 else shown[:60] + " ... " + shown[-55:]
            raise ConfigError(f"the config is nested deeper than {MAX_DEPTH} levels (at {shown}; a section "
                              "holding itself through a reference, or a chain of sections referring to the next)")
        best[id(node)] = depth
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        stack.extend((child, depth + 1, (key, link)) for key, child in items)


def check_size(data: Any) -> None:
    """Refuse a document whose YAML aliases expand to more than
    :data:`INTERPOLATION_BUDGET` values (a 0.5 KB "billion laughs" document expands to
    10^10): each shared container is counted once, with its expanded size."""
    size: Dict[int, int] = {}
    stack: list = [(data, False)]
    while stack:
        node, ready = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)) or (id(node) in size and not ready):
            continue
        children = list(node.values() if isinstance(node, Mapping) else node)
        if ready:
            size[id(node)] = min(INTERPOLATION_BUDGET + 1, 1 + sum(
                size.get(id(c), 1) if isinstance(c, (Mapping, list, tuple)) else 1 for c in children))
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if isinstance(c, (Mapping, list, tuple)) and id(c) not in size)
    if size.get(id(data), 1) > INTERPOLATION_BUDGET:
        raise ConfigError(f"the config expands to more than {INTERPOLATION_BUDGET} values "
                          "(YAML aliases repeat sections)")


def copy_plain(data: Any) -> Any:
    """A copy of a config in plain containers (iterative): the working copy values
    are resolved in, apart from the config as written."""
    return _copy(data)
