"""Checks of the settings a user hands the runtime, in the types the device will use.

Each check returns the value in its plain Python type (numpy and 0-d torch scalars included) or
raises ``TypeError`` (wrong kind of value) or ``ValueError`` (out of range) whose message names
the field, the value given and what it must be, e.g. ``max_new_tokens=3.9: must be an integer
>= 1``. Booleans are not integers here (``top_k=True`` is a bug, not a 1) and floats are not
integers even when integral (``3.0`` may be ``2.9999`` computed). Real settings are checked as
float32 too, the dtype sampling runs in: a value that overflows to inf or rounds out of its
range there is refused. :func:`converter` turns a check into an attrs converter, so that
records refuse bad settings when they are built. (``speculum.spec.checks`` is the other kind of
check: of tensors, at run time, per batch row.)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np
import torch

__all__ = [
    "INT64_MIN",
    "INT64_MAX",
    "integer",
    "sequence",
    "integers",
    "real",
    "flag",
    "instance",
    "choice",
    "names",
    "converter",
]

T = TypeVar("T")

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _scalar(value: object) -> object:
    """A 0-d tensor's Python value (``tensor(3)`` is the integer 3); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool:
        return value.item()
    return value


def _type_name(value: object) -> str:
    """The name of the value's type, for messages: "not float", "not NoneType"."""
    return type(value).__name__


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    return "" if maximum is None else f" <= {maximum}"


def integer(
    field: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    fix: str = "",
) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]`` (either bound optional).

    ``fix``, when given, is appended to the message (what to do instead).
    """
    plain = _scalar(value)
    integral = isinstance(plain, numbers.Integral) and not isinstance(plain, (bool, np.bool_))
    number = int(plain) if integral else None
    below = number is not None and minimum is not None and number < minimum
    if number is not None and not below and (maximum is None or number <= maximum):
        return number
    rule = f"{field}={value!r}: must be an integer{_bounds(minimum, maximum)}"
    hint = f"; {fix}" if fix else ""
    if not integral:
        raise TypeError(f"{rule}, not {_type_name(value)}{hint}")
    raise ValueError(f"{rule}{hint}")


def sequence(field: str, values: object, *, of: str, fix: str = "") -> tuple[Any, ...]:
    """``values`` as a tuple (a bare string is not a sequence of anything here); ``of`` names
    what its items must be, for the message."""
    rule = f"must be a sequence of {of}"
    hint = f"; {fix}" if fix else ""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{field}={values!r}: {rule}, not {_type_name(values)}{hint}")
    try:
        return tuple(values)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{field}={values!r}: {rule}, not {_type_name(values)}{hint}") from None


def integers(field: str, values: object, *, minimum: int | None = None) -> tuple[int, ...]:
    """``values`` (a sequence, 1-D array or 1-D integer tensor) as a tuple of ``int``, each
    checked by :func:`integer` under the name ``field[i]``."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()  # one conversion, not a tensor object per element
    items = sequence(field, values, of="integers", fix="wrap a single one, e.g. (7,)")
    # Plain ints (a prompt's thousands of token ids, typically) are checked at C speed.
    if all(type(v) is int for v in items) and (minimum is None or min(items, default=0) >= minimum):
        return items
    return tuple(integer(f"{field}[{i}]", v, minimum=minimum) for i, v in enumerate(items))


def real(
    field: str, value: object, *, low: float, high: float = math.inf, open_low: bool = False
) -> float:
    """``value`` as a ``float`` in ``[low, high]`` (``(low, high]`` with ``open_low``), finite,
    and still so once rounded to float32, the dtype the device samples in."""
    plain = _scalar(value)
    if high == math.inf:
        rule = f"must be a finite number {'>' if open_low else '>='} {low:g}"
    else:
        rule = f"must be a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    if not isinstance(plain, numbers.Real) or isinstance(plain, (bool, np.bool_)):
        raise TypeError(f"{field}={value!r}: {rule}, not {_type_name(value)}")
    number = float(plain)

    def within(x: float) -> bool:
        return math.isfinite(x) and (x > low if open_low else x >= low) and x <= high

    if not within(number):
        raise ValueError(f"{field}={value!r}: {rule}")
    as_float32 = torch.tensor(number, dtype=torch.float32).item()
    if not within(as_float32):
        largest = f" (the largest float32 is {_FLOAT32_MAX:.8g})" if math.isinf(as_float32) else ""
        raise ValueError(
            f"{field}={value!r} becomes {as_float32!r} in float32, the dtype sampling runs "
            f"in{largest}: {rule} there too"
        )
    return number


def flag(field: str, value: object) -> bool:
    """``value`` as a ``bool``; only ``True`` and ``False`` are flags (not ``1`` or ``"no"``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{field}={value!r}: must be True or False, not {_type_name(value)}")
    return bool(value)


def instance(field: str, value: T, *, kind: type | tuple[type, ...]) -> T:
    """``value`` itself, if it is a ``kind`` (or one of the ``kind`` tuple)."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{field}={value!r}: must be of type {names}, not {_type_name(value)}")
    return value


def choice(field: str, value: object, *, among: tuple[str, ...]) -> str:
    """``value`` itself, if it is one of the words ``among``."""
    if not isinstance(value, str):
        raise TypeError(f"{field}={value!r}: must be a str, one of {', '.join(among)}")
    if value not in among:
        raise ValueError(f"{field}={value!r}: choose one of {', '.join(among)}")
    return value


def names(
    field: str, value: object, *, among: tuple[str, ...], items: str, kinds: str, example: str
) -> tuple[str, ...]:
    """``value``, a collection of the words ``among`` (not a bare string), as a sorted tuple
    without repeats; ``items`` names what it holds and ``kinds`` its unknown members, for the
    messages (``"stage names"``, ``"stages"``), and ``example`` shows a good value."""
    if isinstance(value, str) or not isinstance(value, (tuple, list, frozenset, set)):
        raise ValueError(
            f"{field}={value!r}: give a tuple of {items} from {', '.join(among)}, e.g. {example}"
        )
    unknown = [v for v in value if v not in among]
    if unknown:
        raise ValueError(
            f"{field} names unknown {kinds} {unknown!r}: choose from {', '.join(among)}"
        )
    return tuple(sorted(set(value)))


def converter(check: Callable[..., Any], *, optional: bool = False, **rule: Any) -> attrs.Converter:
    """An attrs converter running ``check(field name, value, **rule)`` on a field; with
    ``optional``, ``None`` passes unchecked (the setting's default)."""

    def convert(value: object, field: attrs.Attribute) -> object:
        if optional and value is None:
            return None
        return check(field.name, value, **rule)

    return attrs.Converter(convert, takes_field=True)
