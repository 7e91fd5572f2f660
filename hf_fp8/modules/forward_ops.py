"""The operations a module's ``forward`` performs, read from its source with ``ast``.

Experts kinds outside transformers' experts interface (``Fp8BmmExperts``,
``Fp8ParallelExperts``) are recognised from their structure. Their parameters alone do not
say what the forward computes: a look-alike that scales, clamps or branches would be
converted as the plain kind and lose that operation silently. :func:`forward_ops` lists
what the forward does — the functions it calls, its arithmetic outside shape arguments and
its statement kinds — so that a kind accepts only forwards made of its own operations.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

# calls whose arguments are shapes: arithmetic there computes sizes, not values
_SHAPE_CALLS = frozenset({"view", "reshape", "split"})


@dataclass(frozen=True)
class ForwardOps:
    """What a forward does: called names (``torch.bmm`` -> ``"bmm"``), binary and unary
    operators on values (not inside shape arguments, not on constants), statement kinds."""

    calls: frozenset[str]
    operators: tuple[str, ...]
    statements: frozenset[str]

    def only(self, calls: set[str], operators: tuple[str, ...], statements: set[str]) -> bool:
        """True when the forward calls nothing but ``calls``, applies exactly ``operators``
        (in source order) and has no statement kinds beyond ``statements``."""
        return (
            self.calls <= calls
            and self.operators == operators
            and self.statements <= statements | {"Expr", "Assign", "Return"}
        )


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return "<expression>"


class _Walker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.calls: set[str] = set()
        self.operators: list[str] = []
        self.statements: set[str] = set()

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            self.statements.add(type(node).__name__)
        super().generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node.func)
        self.calls.add(name)
        self.visit(node.func)
        if name in _SHAPE_CALLS:  # only the tensor it is called on carries values
            return
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            self.visit(arg)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.operators.append(type(node.op).__name__)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.statements.add("AugAssign")
        self.operators.append(type(node.op).__name__)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if not isinstance(node.operand, ast.Constant):  # -1 is a constant, -x an operation
            self.operators.append(type(node.op).__name__)
        self.generic_visit(node)


def forward_ops(cls: type) -> ForwardOps | None:
    """The operations of ``cls.forward`` (see the module docstring), or ``None`` when its
    source cannot be read or the forward is decorated (a decorator may change the call)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(function, ast.FunctionDef) or function.decorator_list:
        return None
    walker = _Walker()
    for statement in function.body:
        walker.visit(statement)
    return ForwardOps(
        calls=frozenset(walker.calls),
        operators=tuple(walker.operators),
        statements=frozenset(walker.statements),
    )
