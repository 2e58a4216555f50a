"""`megatron_compat` against Megatron-Core (CPU): the version its patches were written for is the
one requirements.txt pins, and every Megatron-Core attribute a patch replaces or relies on still
exists in the installed one, so an upgrade fails here, patch by patch, rather than in a GPU run."""
import logging


def test_the_pinned_megatron_core_is_the_one_the_patches_were_written_for():
    import re
    from pathlib import Path

    import megatron_compat

    pin = re.search(r"^megatron-core==(\S+)", (Path(__file__).parent.parent / "requirements.txt").read_text(), re.M)
    assert pin and pin.group(1) == megatron_compat.WRITTEN_FOR, \
        "re-check every patch of megatron_compat.PATCHES against the pinned megatron-core, then update WRITTEN_FOR"



def test_every_patched_megatron_attribute_exists():
    import megatron_compat

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

    import megatron_compat

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger="megatron_compat"):
        megatron_compat._check_version()
    (record,) = caplog.records
    message = record.getMessage()
    assert "0.99.0" in message and megatron_compat.WRITTEN_FOR in message
    assert all(f"  {name}: " in message for name, *_ in megatron_compat.PATCHES)
