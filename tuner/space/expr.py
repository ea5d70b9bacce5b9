"""The expression language of derived keys, conditions (``when``) and constraints.

An expression is parsed with :mod:`ast` and evaluated by walking a whitelist (numbers, strings,
true/false/null, dotted keys, ``+ - * / // %``, comparisons, and/or/not, ``min``/``max``); nothing is
``eval``-ed. Names are dotted config keys, looked up in a flat effective config by a :class:`Resolver`.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Callable, Optional

from trainer.config import follow

__all__ = ["ExprError", "Expr", "Lookup", "truthy", "Resolver"]


class ExprError(ValueError):
    pass


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# YAML spellings too, so `== false` reads like the YAML around it.
_CONSTANT_NAMES = {"true": True, "false": False, "True": True, "False": False, "null": None, "None": None}
_FUNCS = {"min": min, "max": max}

Lookup = Callable[[str], Any]


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class Expr:
    """A whitelisted arithmetic/boolean expression over dotted config keys."""

    def __init__(self, text: Any):
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise ExprError(f"expected an expression string, got {type(text).__name__} {text!r}")
        self.text = str(text).strip()
        if not self.text:
            raise ExprError("empty expression")
        try:
            tree = ast.parse(self.text, mode="eval")
        except SyntaxError as e:
            raise ExprError(f"bad expression {self.text!r}: {e.msg}") from None
        self.names: set[str] = set()
        self._fn = self._compile(tree.body)

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"

    def __call__(self, lookup: Lookup) -> Any:
        try:
            return self._fn(lookup)
        except ExprError:
            raise
        except (TypeError, ZeroDivisionError, ValueError) as e:
            raise ExprError(f"{self.text!r}: {e}") from None

    def _compile(self, node: ast.AST) -> Callable[[Lookup], Any]:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float, str, bool)) or node.value is None:
                value = node.value
                return lambda lk: value
            raise ExprError(f"bad expression {self.text!r}: constant {node.value!r} not allowed")
        if isinstance(node, ast.Name) and node.id in _CONSTANT_NAMES:
            value = _CONSTANT_NAMES[node.id]
            return lambda lk: value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node)
            if name is None:
                raise ExprError(f"bad expression {self.text!r}: only dotted config keys may be used as names")
            self.names.add(name)
            return lambda lk: lk(name)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            op = _BINOPS[type(node.op)]
            left, right = self._compile(node.left), self._compile(node.right)
            return lambda lk: op(left(lk), right(lk))
        if isinstance(node, ast.UnaryOp):
            operand = self._compile(node.operand)
            if isinstance(node.op, ast.Not):
                return lambda lk: not operand(lk)
            if isinstance(node.op, ast.USub):
                return lambda lk: -operand(lk)
            if isinstance(node.op, ast.UAdd):
                return lambda lk: +operand(lk)
        if isinstance(node, ast.BoolOp):
            values = [self._compile(v) for v in node.values]
            if isinstance(node.op, ast.And):
                return lambda lk: all(v(lk) for v in values)
            return lambda lk: any(v(lk) for v in values)
        if isinstance(node, ast.Compare) and all(type(o) in _CMPOPS for o in node.ops):
            left = self._compile(node.left)
            ops = [_CMPOPS[type(o)] for o in node.ops]
            rights = [self._compile(c) for c in node.comparators]

            def compare(lk: Lookup) -> bool:
                a = left(lk)
                for op, r in zip(ops, rights):
                    b = r(lk)
                    if not op(a, b):
                        return False
                    a = b
                return True

            return compare
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
            and node.args
        ):
            fn = _FUNCS[node.func.id]
            args = [self._compile(a) for a in node.args]
            return lambda lk: fn(*(a(lk) for a in args))
        raise ExprError(
            f"bad expression {self.text!r}: {type(node).__name__} is not allowed "
            "(numbers, dotted keys, + - * / // %, comparisons, and/or/not, min/max)"
        )


def truthy(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ExprError(f"{where} must be true or false, got {value!r}")


class Resolver:
    """Name lookup over a flat effective config; ``None`` "follow another key" defaults resolved."""

    def __init__(self, eff: dict):
        self.eff = eff

    def __call__(self, name: str) -> Any:
        return follow(self.eff, name)
