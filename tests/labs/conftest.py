"""The labs' shared fixture: each lab's buggy variants graded once per session."""

from __future__ import annotations

import pytest

from helpers.labtests import grade_variants
from helpers.variants import variant_data


@pytest.fixture(scope="session")
def graded_variants(tmp_path_factory):
    """``graded_variants(lab_name)``: that lab's variants graded (name -> GradeReport), once."""
    from attnlab import labs

    done: dict = {}

    def get(name: str) -> dict:
        if name not in done:
            data = variant_data()[name]
            lab = labs.find_lab(name)
            done[name] = grade_variants(name, lab.file, data.VARIANTS, tmp_path_factory.mktemp(name), seed=data.SEED)
        return done[name]

    return get
