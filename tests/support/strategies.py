"""Hypothesis strategies the property-based tests share (importable from every test directory,
as ``cli_helpers`` is)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


def json_values(keys: Sequence[str], words: Sequence[str], *, allow_nan: bool) -> st.SearchStrategy:
    """Arbitrary JSON values whose object keys and strings lean on ``keys`` and ``words`` (the
    names a boundary reads), so draws get past its first check. ``allow_nan``: NaN, which
    Python's ``json`` writes but strict JSON lacks."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=allow_nan),
        st.text(max_size=30),
        st.sampled_from(list(words)),
    )
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(
                st.one_of(st.sampled_from(list(keys)), st.text(max_size=10)), children, max_size=6
            ),
        ),
        max_leaves=30,
    )
