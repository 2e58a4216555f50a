"""`megatron_compat` against Megatron-Core (CPU): the version its patches were written for is the
one requirements.txt pins, and every Megatron-Core attribute a patch replaces or relies on still
exists in the installed one, so an upgrade fails here, patch by patch, rather than in a GPU run."""
import logging


def test_the_pinned_megatron_core_is_the_one_the_patches_were_written_for():
    import re
    from pathlib import Path

    from ftrain.engines import megatron_compat

    pin = re.search(r"^megatron-core==(\S+)", (Path(__file__).resolve().parents[2] / "requirements.txt").read_text(), re.M)
    assert pin and pin.group(1) == megatron_compat.WRITTEN_FOR, \
        "re-check every patch of megatron_compat.PATCHES against the pinned megatron-core, then update WRITTEN_FOR"



def test_every_patched_megatron_attribute_exists():
    from ftrain.engines import megatron_compat

    missing = []
    for patch, module, attributes, why in megatron_compat.PATCHES:
        assert callable(getattr(megatron_compat, patch)), patch
        for attribute in attributes:
            try:
                assert callable(megatron_compat.patch_target(module, attribute))
            except (ImportError, AttributeError, AssertionError) as exc:
                missing.append(f"{patch}: {module}.{attribute} ({why}): {exc!r}")
    assert not missing, "\n".join(missing)


def test_another_version_logs_one_warning_naming_each_patch(monkeypatch, caplog):
    import megatron.core

    from ftrain.engines import megatron_compat

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger="ftrain.engines.megatron_compat"):
        megatron_compat._check_version()
    (record,) = caplog.records
    message = record.getMessage()
    assert "0.99.0" in message and megatron_compat.WRITTEN_FOR in message
    assert all(f"  {name}: " in message for name, *_ in megatron_compat.PATCHES)


def test_the_foreach_grad_norm_and_scale_are_megatrons_math():
    """The sync-free replacements of Megatron-Core's local clip-grad helpers: the global L2 norm
    of a list of tensors, and dst = src * scale (in place when src is dst)."""
    import torch

    from ftrain.engines.megatron_compat import _foreach_l2_norm, _foreach_scale

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in (3, 70, 1)]
    norm, _ = _foreach_l2_norm(0, None, [grads], False)
    assert norm.shape == (1,)
    assert torch.allclose(norm[0], torch.linalg.vector_norm(torch.cat(grads)), rtol=1e-6)
    expected = [x * 0.5 for x in grads]
    _foreach_scale(0, None, [grads, grads], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    out = [torch.empty_like(x) for x in grads]
    _foreach_scale(0, None, [grads, out], 2.0)
    assert all(torch.equal(a, b * 2.0) for a, b in zip(out, grads))
