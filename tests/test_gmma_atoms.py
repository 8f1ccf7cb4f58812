"""kernels/sm90/common/gmma_atoms.h is tools/gen_gmma_atoms.py's output (CPU, no GPU): the atoms
of the widths CuTe's base headers lack are generated, never edited by hand, and each one's PTX
names its own shape, types and operand count."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "kernels" / "sm90" / "common" / "gmma_atoms.h"


def test_header_is_the_generators_output():
    rc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_gmma_atoms.py"), "--check"],
                        check=False).returncode
    assert rc == 0, "regenerate: python3 tools/gen_gmma_atoms.py"


def test_each_atom_has_its_shapes_operands():
    text = HEADER.read_text()
    atoms = re.findall(r"struct (SS_64x(\d+)x(\d+)_F32(\w+?)) \{(.*?)\n\};", text, re.DOTALL)
    assert len(atoms) == 8
    ptx_types = {"F16F16": "f16", "BF16BF16": "bf16", "E4M3E4M3": "e4m3"}
    for name, n, k, types, body in atoms:
        n, k, regs = int(n), int(k), int(n) // 2
        assert k == (32 if types == "E4M3E4M3" else 16), name
        assert f"CRegisters = float[{regs}];" in body, name
        t = ptx_types[types]
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{t}.{t} {{" in body, name
        # the accumulators %0 .. %(regs - 1), then both descriptors, the scale-d predicate and
        # the immediates (scale A / B, and the transposes for 16-bit operands)
        listed = re.search(r"\{\"(.*?)\}, \"", body, re.DOTALL).group(1)
        refs = [int(x) for x in re.findall(r"%(\d+)", listed)]
        assert refs == list(range(regs)), name
        assert body.count('"+f"(d') == regs and f"float& d{regs - 1}," in body, name
        imms = 2 if types == "E4M3E4M3" else 4
        tail = f"%{regs}, %{regs + 1}, p, " + ", ".join(f"%{regs + 3 + i}" for i in range(imms))
        assert tail + ";" in body and f"setp.ne.b32 p, %{regs + 2}, 0;" in body, name
