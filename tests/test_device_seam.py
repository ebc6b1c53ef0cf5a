"""The device is decided in one place: outside blend/backend.py (and blend/model.py, which resolves the device a
model loads on) no module of the packages branches on a device type. What a module needs from the device it
asks the backend for (its plans, staging, sync, decode step, key columns, graphs, `placement` for the store)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_BRANCH = re.compile(r"device\.type|is_cuda|torch\.cuda\.is_available\(\)|\.type *[=!]= *['\"](cuda|cpu)")
PACKAGES = ("app", "blend", "retrieval", "common", "store")
ALLOWED = {"blend/backend.py", "blend/model.py"}


def checked(path: Path) -> bool:
    return path.relative_to(ROOT).as_posix() not in ALLOWED


def test_no_module_outside_the_backend_branches_on_the_device():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if checked(path)
             for number, line in enumerate(path.read_text().splitlines(), 1) if DEVICE_BRANCH.search(line)]
    assert not found, "device branches outside blend/backend.py and blend/model.py:\n" + "\n".join(found)


def test_the_check_sees_a_branch():
    assert DEVICE_BRANCH.search('if x.device.type == "cuda":') and DEVICE_BRANCH.search("torch.cuda.is_available()")
    assert not DEVICE_BRANCH.search("placement.pin")
