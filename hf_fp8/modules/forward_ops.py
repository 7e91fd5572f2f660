"""The operations a module's ``forward`` performs, read from its source with ``ast``.

Experts kinds outside transformers' experts interface (``Fp8BmmExperts``,
``Fp8ParallelExperts``) are recognised from their structure. Their parameters alone do not
say what the forward computes: a look-alike that scales, clamps, transposes or branches would
be converted as the plain kind and lose that operation silently. :func:`forward_ops` lists
what the forward does, each name resolved rather than matched as text:

* calls: a global function by identity (``torch.bmm``, ``F.linear`` whatever it is imported
  as; a local function called ``linear`` is not ``F.linear``), ``self.<child>`` by the child
  module's name, a method of a value by its name (``.view``, ``.chunk``);
* arithmetic on values (not inside the shape arguments of ``view`` / ``reshape`` / ``split``,
  not on constants) and statement kinds;
* anything else it cannot vouch for (``unknown``): a method or property of the class
  called or read through ``self``, an attribute of a value other than ``.shape`` (``.mT``),
  a lambda, a decorated forward, an overridden ``__call__``, an instance ``forward`` or hooks.

A kind accepts only forwards made of its own operations (:meth:`ForwardOps.only`).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_fp8.modules.weight_reads import self_attribute

# global functions a kind may call, by identity
_FUNCTIONS: dict[Any, str] = {
    torch.bmm: "bmm",
    torch.cat: "cat",
    torch.nn.functional.linear: "linear",
    torch.reshape: "reshape",
    torch.split: "split",
    range: "range",
}
# calls whose other arguments are shapes: arithmetic there computes sizes, not values
_SHAPE_CALLS = frozenset({"view", "reshape", "split"})
_VALUE_ATTRIBUTES = frozenset({"shape"})  # attributes a forward may read from a value


@dataclass(frozen=True)
class ForwardOps:
    """What a forward does (see the module docstring)."""

    calls: frozenset[str]
    operators: tuple[str, ...]
    statements: frozenset[str]
    unknown: tuple[str, ...]

    def only(self, calls: set[str], operators: tuple[str, ...], statements: set[str]) -> bool:
        """True when the forward calls nothing but ``calls``, applies exactly ``operators``
        (in source order), has no statement kinds beyond ``statements`` and nothing unknown."""
        return (
            not self.unknown
            and self.calls <= calls
            and self.operators == operators
            and self.statements <= statements | {"Expr", "Assign", "Return"}
        )


class _Walker(ast.NodeVisitor):
    def __init__(self, module: nn.Module, scope: dict[str, Any]) -> None:
        self.module = module
        self.scope = scope
        self.children = {name for name, _ in module.named_children()}
        self.calls: set[str] = set()
        self.operators: list[str] = []
        self.statements: set[str] = set()
        self.unknown: list[str] = []
        self.in_shape = 0  # > 0 inside the shape arguments of a shape call

    def _resolve(self, node: ast.expr) -> Any:
        """The object a dotted global name (``torch.nn.functional.linear``) stands for."""
        if isinstance(node, ast.Name):
            if node.id in self.scope:
                return self.scope[node.id]
            return getattr(builtins, node.id, None)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return None if base is None else getattr(base, node.attr, None)
        return None

    def _value_attribute_ok(self, name: str) -> bool:
        """``self.<name>`` read as a value: a parameter, buffer or plain instance attribute
        (not a method, property or anything else the class computes)."""
        if name in dict(self.module.named_parameters(recurse=False)):
            return True
        if name in dict(self.module.named_buffers(recurse=False)):
            return True
        value = self.module.__dict__.get(name, None)
        return name in self.module.__dict__ and not callable(value)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            self.statements.add(type(node).__name__)
        super().generic_visit(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.unknown.append("lambda")

    def visit_Attribute(self, node: ast.Attribute) -> None:  # a read, not a call
        own = self_attribute(node)
        if own is not None:
            if not self._value_attribute_ok(own):
                self.unknown.append(f"self.{own}")
            return
        if isinstance(self._resolve(node), type(torch)):  # a module path: torch.nn
            return
        if node.attr not in _VALUE_ATTRIBUTES:
            self.unknown.append(f".{node.attr}")
        self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        target = self._resolve(func)
        own = self_attribute(func)
        values: list[ast.expr] = []  # arguments that carry values (the rest: shapes)
        if target is not None:  # a global function, called by whatever name
            name = _FUNCTIONS.get(target)
            if name is None:
                self.unknown.append(f"call {ast.unparse(func)}")
                return
            if name in _SHAPE_CALLS:  # torch.reshape(x, shape): x carries the values
                values = node.args[:1]
        elif own is not None:  # self.<child>(...): a child module; methods are unknown
            name = f"self.{own}"
            if own not in self.children:
                self.unknown.append(f"call self.{own}")
                return
        elif isinstance(func, ast.Attribute):  # a method of a value: x.view(...)
            name = f".{func.attr}"
            self.visit(func.value)
        else:
            self.unknown.append(f"call {ast.unparse(func)}")
            return
        self.calls.add(name)
        arguments = [*node.args, *(k.value for k in node.keywords)]
        if name.lstrip(".") not in _SHAPE_CALLS:
            values = arguments
        for arg in arguments:
            if any(arg is v for v in values):
                self.visit(arg)
            else:
                self.in_shape += 1
                self.visit(arg)
                self.in_shape -= 1

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if not self.in_shape:
            self.operators.append(type(node.op).__name__)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.statements.add("AugAssign")
        self.operators.append(type(node.op).__name__)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if not self.in_shape and not isinstance(node.operand, ast.Constant):  # -1 is constant
            self.operators.append(type(node.op).__name__)
        self.generic_visit(node)


def call_changes(module: nn.Module) -> list[str]:
    """What changes ``module``'s call beyond its class's ``forward``: hooks, an instance
    ``forward`` (accelerate's ``add_hook_to_module`` sets one), an own ``__call__``. A module
    swapped for an FP8 one would lose them silently."""
    found = [
        what
        for what, hooks in (
            ("forward hooks", module._forward_hooks),
            ("forward pre-hooks", module._forward_pre_hooks),
            ("backward hooks", module._backward_hooks),
            ("backward pre-hooks", module._backward_pre_hooks),
        )
        if hooks
    ]
    if "forward" in module.__dict__:
        found.append("an instance forward")
    if type(module).__call__ is not nn.Module.__call__:
        found.append("its own __call__")
    return found


def forward_ops(module: nn.Module) -> ForwardOps | None:
    """The operations of ``module``'s forward (see the module docstring), or ``None`` when
    its source cannot be read."""
    cls = type(module)
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(function, ast.FunctionDef):
        return None
    walker = _Walker(module, {**getattr(cls.forward, "__globals__", {})})
    if function.decorator_list:
        walker.unknown.append("decorated forward")
    walker.unknown.extend(call_changes(module))
    for statement in function.body:
        walker.visit(statement)
    return ForwardOps(
        calls=frozenset(walker.calls),
        operators=tuple(walker.operators),
        statements=frozenset(walker.statements),
        unknown=tuple(walker.unknown),
    )
