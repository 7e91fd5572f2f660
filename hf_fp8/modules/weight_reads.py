"""Which children's ``.weight`` a module reads itself, from its source (``ast``).

A parent that uses ``self.<child>.weight`` instead of calling the child (a tensor op on the
weight, or only its dtype: T5-style feed-forwards cast their input to
``self.wo.weight.dtype``) must keep that child in high precision: an FP8 weight there is
multiplied as raw codes or raises "Promotion for Float8 Types".

Every method the instance runs is read (inherited ones included, weight initialisation left
out), every read counts wherever it is: under a condition, in a nested expression or
function. A condition may hold on another machine (the Mamba mixers' CUDA-kernel branch
passes ``x_proj`` / ``out_proj`` weights to the fused kernel) and the saved model must run
there. The one exception is a branch this instance's own settings close: a read inside
``if <guard> and ...:`` where a guard is a plain instance attribute (``self.slow_but_exact``,
``self.pretraining_tp > 1`` compared with a constant) that is false on the instance (Bloom's
``slow_but_exact`` branch, off in its config, slices ``dense.weight``). Modes switched at run
time never close a branch: ``self.training`` and any attribute a method of the class (or of
a base class) other than ``__init__`` assigns (``self.x = ...``, ``self.x += ...``,
``setattr(self, "x", ...)``): a flag that ``forward`` sets is false on a fresh instance only.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn

_INIT_METHODS = ("__init__", "_init_weights", "reset_parameters", "init_weights")
# a guard: (instance attribute, test, constant); test "truthy" / "falsy" or a comparison
Guard = tuple[str, str, Any]
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "Gt": operator.gt,
    "GtE": operator.ge,
    "Lt": operator.lt,
    "LtE": operator.le,
    "Eq": operator.eq,
    "NotEq": operator.ne,
    "Is": operator.is_,
    "IsNot": operator.is_not,
}
_PLAIN = (bool, int, float, str, type(None))
# modes switched at run time (model.train(), gradient_checkpointing_enable()), not settings
_RUNTIME_FLAGS = frozenset({"training", "gradient_checkpointing"})


def self_attribute(node: ast.expr) -> str | None:
    """``name`` when ``node`` is ``self.<name>``, else ``None``."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _guards(test: ast.expr) -> tuple[Guard, ...]:
    """The conjuncts of an ``if`` test that an instance can decide: ``self.a``,
    ``not self.a``, ``self.a <op> <constant>``. Other conjuncts are left out (undecided)."""
    terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    out: list[Guard] = []
    for term in terms:
        if (attr := self_attribute(term)) is not None:
            out.append((attr, "truthy", None))
        elif isinstance(term, ast.UnaryOp) and isinstance(term.op, ast.Not):
            if (attr := self_attribute(term.operand)) is not None:
                out.append((attr, "falsy", None))
        elif (
            isinstance(term, ast.Compare)
            and len(term.ops) == 1
            and type(term.ops[0]).__name__ in _COMPARE
            and isinstance(term.comparators[0], ast.Constant)
            and (attr := self_attribute(term.left)) is not None
        ):
            out.append((attr, type(term.ops[0]).__name__, term.comparators[0].value))
    return tuple(out)


class _Reads(ast.NodeVisitor):
    """``(child, guards)`` of every ``self.<child>.weight``; ``guards``: those of the ``if``
    statements whose body holds the read."""

    def __init__(self) -> None:
        self.found: set[tuple[str, tuple[Guard, ...]]] = set()
        self.stack: list[tuple[Guard, ...]] = []

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self.stack.append(_guards(node.test))
        for statement in node.body:
            self.visit(statement)
        self.stack.pop()
        for statement in node.orelse:
            self.visit(statement)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "weight" and (child := self_attribute(node.value)) is not None:
            self.found.add((child, tuple(g for gs in self.stack for g in gs)))
        self.generic_visit(node)


def _methods(cls: type) -> dict[str, Any]:
    """The methods an instance of ``cls`` runs, by name: each from the first class of the
    MRO that defines it (inherited ones included), torch's own classes left out."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch."):
            continue
        for attr, fn in vars(klass).items():
            found.setdefault(attr, fn)
    return {a: fn for a, fn in found.items() if inspect.isfunction(fn)}


def _names_attribute(code: Any, attr: str) -> bool:
    """``code`` (or a function / comprehension nested in it) reads an attribute ``attr``:
    an exact pre-test on the code object, before reading any source."""
    return attr in code.co_names or any(
        _names_attribute(c, attr) for c in code.co_consts if hasattr(c, "co_names")
    )


@functools.cache
def _function_reads(fn: Any) -> frozenset[tuple[str, tuple[Guard, ...]]]:
    """``(child, guards)`` of every ``self.<child>.weight`` in ``fn``; nothing without a
    source. Cached per function: the base classes' methods (``PreTrainedModel``'s ~100)
    are read once a process, and only those whose code names ``weight`` are parsed."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # a decorated forward: its own code
    if code is not None and not _names_attribute(code, "weight"):
        return frozenset()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    reads = _Reads()
    reads.visit(tree)
    return frozenset(reads.found)


@functools.cache
def class_weight_reads(cls: type) -> dict[str, frozenset[tuple[Guard, ...]]]:
    """``{child: guards of each read}`` over the methods of ``cls`` (see the module
    docstring)."""
    out: dict[str, set[tuple[Guard, ...]]] = {}
    for attr, fn in _methods(cls).items():
        if attr not in _INIT_METHODS:
            for child, guards in _function_reads(fn):
                out.setdefault(child, set()).add(guards)
    return {child: frozenset(g) for child, g in out.items()}


class _Assigns(ast.NodeVisitor):
    """Whether ``self.<attr>`` is assigned (or deleted) anywhere in a function."""

    def __init__(self, attr: str) -> None:
        self.attr = attr
        self.found = False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self_attribute(node) == self.attr:
            self.found = True
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:  # setattr(self, "attr", value)
        args = node.args
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and len(args) >= 2
            and isinstance(args[0], ast.Name)
            and args[0].id == "self"
            and isinstance(args[1], ast.Constant)
            and args[1].value == self.attr
        ):
            self.found = True
        self.generic_visit(node)


def _names_constant(code: Any, value: str) -> bool:
    return value in code.co_consts or any(
        _names_constant(c, value) for c in code.co_consts if hasattr(c, "co_consts")
    )


@functools.cache
def _function_assigns(fn: Any, attr: str) -> bool:
    """``fn`` assigns ``self.<attr>``; without a source, it is assumed to (never closes)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is not None and not (_names_attribute(code, attr) or _names_constant(code, attr)):
        return False  # exact pre-test: the name appears nowhere in the code
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return True
    visitor = _Assigns(attr)
    visitor.visit(tree)
    return visitor.found


@functools.cache
def assigned_at_run_time(cls: type, attr: str) -> bool:
    """A method of ``cls`` or of a base class (not torch's), other than ``__init__``,
    assigns ``self.<attr>``: a mode switched at run time, not a setting."""
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch."):
            continue
        for name, fn in vars(klass).items():
            fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
            if name != "__init__" and inspect.isfunction(fn) and _function_assigns(fn, attr):
                return True
    return False


def _setting(module: nn.Module, guard: Guard) -> Any:
    """The value of the setting ``guard`` tests on ``module`` (a plain attribute it holds
    itself that no method switches at run time), or ``...`` when the guard is undecided."""
    attr = guard[0]
    if attr in _RUNTIME_FLAGS or assigned_at_run_time(type(module), attr):
        return ...
    value = module.__dict__.get(attr, ...)
    return value if isinstance(value, _PLAIN) else ...  # property, tensor, missing: undecided


def _closed(module: nn.Module, guard: Guard) -> bool:
    """True when ``guard`` is false on ``module`` (see :func:`_setting`)."""
    _, test, constant = guard
    value = _setting(module, guard)
    if value is ...:
        return False
    try:
        if test == "truthy":
            return not value
        if test == "falsy":
            return bool(value)
        return not _COMPARE[test](value, constant)
    except TypeError:
        return False


def reads_weight_of(parent: nn.Module, child_name: str) -> bool:
    """``parent`` reads ``self.<child_name>.weight`` on a path its settings leave open."""
    reads = class_weight_reads(type(parent)).get(child_name, ())
    return any(not any(_closed(parent, g) for g in guards) for guards in reads)


_SYMBOLS = {"Gt": ">", "GtE": ">=", "Lt": "<", "LtE": "<=", "Eq": "==", "NotEq": "!="}
_SYMBOLS |= {"Is": "is", "IsNot": "is not"}


def opening_settings(parent: nn.Module, child_name: str) -> tuple[Guard, ...]:
    """The settings of ``parent`` that open every read of ``<child_name>.weight`` keeping
    the child (Bloom: ``pretraining_tp > 1`` and ``slow_but_exact``), or ``()`` when a read
    keeps it whatever the settings (or none does): then only the class decides."""
    reads = class_weight_reads(type(parent)).get(child_name, ())
    found: list[Guard] = []
    for guards in reads:
        if any(_closed(parent, g) for g in guards):
            continue
        settings = [g for g in guards if _setting(parent, g) is not ...]
        if not settings:
            return ()
        found += [g for g in settings if g not in found]
    return tuple(found)


def describe_settings(parent: nn.Module, settings: tuple[Guard, ...]) -> tuple[str, str]:
    """``("pretraining_tp > 1 and slow_but_exact is true", "pretraining_tp=2,
    slow_but_exact=True")``: the conditions and the values ``parent`` holds."""
    conditions = []
    for attr, test, constant in settings:
        if test == "truthy":
            conditions.append(f"{attr} is true")
        elif test == "falsy":
            conditions.append(f"{attr} is false")
        else:
            conditions.append(f"{attr} {_SYMBOLS[test]} {constant!r}")
    values = dict.fromkeys(f"{g[0]}={parent.__dict__[g[0]]!r}" for g in settings)
    return " and ".join(conditions), ", ".join(values)


def closing_hint(settings: tuple[Guard, ...]) -> str:
    """How to close the branch: ``slow_but_exact=False`` for a flag, else the names."""
    for attr, test, _ in settings:
        if test in ("truthy", "falsy"):
            return f"{attr}={test == 'falsy'}"
    return " / ".join(dict.fromkeys(g[0] for g in settings)) + " changed back"
