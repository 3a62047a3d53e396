"""`ddplab doctor` names a companion package (torchvision) that cannot be imported with this torch."""

import sys

from ddplab.tools.doctor import companions


def test_a_torchvision_built_for_another_torch_is_named_with_its_cause(tmp_path, monkeypatch):
    # the CPU torch beside the package index's torchvision (a CUDA build) fails this way at import
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    working = tmp_path / "torchaudio"
    working.mkdir()
    (working / "__init__.py").write_text('__version__ = "2.13.0"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torchvision", "torchaudio"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    found = companions()
    assert found["torchaudio"] == "2.13.0, imports"
    assert found["torchvision"].startswith("cannot be imported with torch ")
    assert "(operator torchvision::nms does not exist)" in found["torchvision"]
    assert companions(("no_such_companion",)) == {}
