"""The versions a stored timing is valid for: attnserve's own is always among them."""

import importlib.metadata as md

import attnserve
from attnserve import versions


def test_attnserve_running_from_a_checkout_still_records_its_version(monkeypatch):
    """Run from a source tree (PYTHONPATH=src, as on the GPU machine) there is no installed distribution;
    the version of the code that runs is recorded all the same, so tune results from there can be judged."""
    real = md.version

    def not_installed(name):
        if name == "attnserve":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(versions.md, "version", not_installed)
    recorded = versions.package_versions()
    assert recorded["attnserve"] == attnserve.__version__
    assert recorded["torch"]
