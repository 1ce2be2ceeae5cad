"""What the package installs: only `sglang_shadowkv` at the top level, so it installs beside any other
distribution (PyPI's `kernels` among them) and both import."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_one_top_level_package_and_installs_beside_one_named_kernels(tmp_path):
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT / "sglang_shadowkv", source / "sglang_shadowkv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("sglang_shadowkv-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist() if not name.split("/")[0].endswith(".dist-info")}
        zf.extractall(site)  # what pip puts in site-packages
    assert tops == {"sglang_shadowkv"}
    other = tmp_path / "other" / "kernels"  # another distribution's top-level `kernels`
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'the other distribution'\n")
    code = ("import kernels, sglang_shadowkv.kernels.rebuild_keys as rk; "
            "print(kernels.WHO); print(rk.__file__)")
    env_path = f"{tmp_path / 'other'}:{site}"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    who, where = out.stdout.splitlines()
    assert who == "the other distribution" and where.startswith(str(site))
