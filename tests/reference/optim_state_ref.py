#!/usr/bin/python3
"""A reference of the engine's packed optimizer state (optimizer.state bf16/int8,
optimizer.master split), written from the algorithm in docs/precision.md ("Optimizer state in
fewer bytes") with numpy, checked bit for bit against the engine's update on every SIMD path.

    optim_state_ref.py TOOL [--work DIR]

TOOL is tests/optim_state_tool (built as fuyou-optim-state-tool). For each format (bf16 and
int8 moments, fp32 and split master) and each SIMD path the CPU has, random groups with edge
cases (zeros, denormals, a block with one large value, tensor boundaries inside blocks,
padding, a ragged last block, a non-finite gradient) go through several steps of the engine and
of this reference; every output array must be equal bit for bit. Exit status 0 when all agree,
1 on the first difference (with its element), 77 when numpy is missing.
"""
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipped")
    sys.exit(77)

F32 = np.float32
U32 = np.uint32
BLOCK = 256
QM, QV = F32(127.0), F32(255.0)
INV_QM2 = F32(1.0) / F32(127.0 * 127.0)
INV_QV2 = F32(1.0) / F32(255.0 * 255.0)
KEY_M, KEY_V = 0x68E31DA4, 0xB5297A4D


def bits(x):
    return np.asarray(x, dtype=F32).view(U32)


def from_bits(u):
    return np.asarray(u, dtype=U32).view(F32)


def fma32(a, b, c):
    """fmaf: a * b + c rounded once to float32, from exact double-double arithmetic."""
    a, b, c = (np.asarray(x, dtype=F32) for x in (a, b, c))
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
        c64 = c.astype(np.float64)
        s = p + c64
        t = s - p
        err = (p - (s - t)) + (c64 - t)  # TwoSum: s + err == p + c exactly
        r = s.astype(F32)
        # s rounds like p + c unless it is exactly halfway between two floats and err breaks
        # the tie.
        toward = np.where(s > r.astype(np.float64), F32(np.inf), F32(-np.inf))
        nb = np.nextafter(r, toward)
        mid = (r.astype(np.float64) != s) & (s - r.astype(np.float64) == nb.astype(np.float64) - s)
        fix = mid & (err != 0) & np.isfinite(s) & np.isfinite(err)
        up = np.maximum(r, nb)
        down = np.minimum(r, nb)
        r = np.where(fix, np.where(err > 0, up, down), r)
    return r.astype(F32)


def mix32(x):
    x = np.asarray(x, dtype=U32).copy()
    x ^= x >> U32(16)
    x *= U32(0x7FEB352D)
    x ^= x >> U32(15)
    x *= U32(0x846CA68B)
    x ^= x >> U32(16)
    return x


def round_key(group, t):
    with np.errstate(over="ignore"):
        return int(mix32(U32((int(mix32(U32(t & 0xFFFFFFFF))) + group * 0x9E3779B9) & 0xFFFFFFFF)))


def round_bits(key, idx):
    return mix32(np.asarray(idx, dtype=U32) ^ U32(key))


def round_uniform(b):
    return (b >> U32(8)).astype(F32) * F32(5.9604644775390625e-8)


def bf16_to_f32(h):
    return from_bits(np.asarray(h, dtype=np.uint16).astype(U32) << U32(16))


def is_nan_bits(u):
    return (u & U32(0x7FFFFFFF)) > U32(0x7F800000)


def bf16_rne(x):
    u = bits(x)
    r = ((u + U32(0x7FFF) + ((u >> U32(16)) & U32(1))) >> U32(16))
    return np.where(is_nan_bits(u), (u >> U32(16)) | U32(0x40), r).astype(np.uint16)


def bf16_stochastic(x, b):
    u = bits(x)
    with np.errstate(over="ignore"):
        r = (u + (b & U32(0xFFFF))) >> U32(16)
    return np.where(is_nan_bits(u), (u >> U32(16)) | U32(0x40), r).astype(np.uint16)


def split_hi(x):
    u = bits(x)
    with np.errstate(over="ignore"):
        r = (u + U32(0x8000)) >> U32(16)
    return np.where(is_nan_bits(u), (u >> U32(16)) | U32(0x40), r).astype(np.uint16)


def split_lo(x):
    u = bits(x)
    hi = split_hi(x).astype(U32)
    with np.errstate(over="ignore"):
        lo = (u - (hi << U32(16))) & U32(0xFFFF)
    return np.where(is_nan_bits(u), U32(0), lo).astype(np.uint16).view(np.int16)


def split_join(hi, lo):
    with np.errstate(over="ignore"):
        return from_bits((hi.astype(U32) << U32(16)) + lo.astype(np.int32).astype(U32))


def code_decode(qq, scale, inv):
    return (scale * (qq.astype(F32) * inv)).astype(F32)


def grid_floor(y):
    """The largest integer k >= 0 with k * k <= y (float32 products, exact below 2^24)."""
    y = np.asarray(y, F32)
    with np.errstate(all="ignore"):
        q0 = np.floor(np.sqrt(y.astype(np.float64))).astype(F32)
        q0 = np.where(q0 * q0 > y, q0 - F32(1), q0).astype(F32)
        q1 = q0 + F32(1)
        return np.where(q1 * q1 <= y, q1, q0).astype(F32)


def grid_position(a, s, Q):
    with np.errstate(all="ignore"):
        inv = F32(Q * Q) / F32(s)
        if np.isfinite(inv):
            y = a * inv
        else:
            y = (a / F32(s)) * F32(Q * Q)
        return np.minimum(y, F32(Q * Q)).astype(F32)


def code_encode(y, Q, u):
    with np.errstate(all="ignore"):
        q0 = grid_floor(y)
        frac = y - q0 * q0
        width = F32(2) * q0 + F32(1)
        q = np.where(u * width < frac, q0 + F32(1), q0)
        q = np.minimum(q, F32(Q))
    return q.astype(np.int32)


def step_consts(lr, b1, b2, eps, t):
    lr, b1, b2 = F32(lr), F32(b1), F32(b2)
    bc2 = F32(math.sqrt(1.0 - math.pow(float(b2), float(t))))
    neg_step = F32(-float(lr) / (1.0 - math.pow(float(b1), float(t))))
    return dict(omb1=F32(1) - b1, b2=b2, omb2=F32(1) - b2, bc2=bc2, eps=F32(eps), neg_step=neg_step)


class State:
    """One group's packed state, as the engine stores it."""

    def __init__(self, moments, master, init, m=None, ms=None, v=None, vs=None):
        n = init.size
        self.moments, self.master, self.n = moments, master, n
        self.hi = split_hi(init)
        self.lo = split_lo(init)
        self.p32 = init.astype(F32).copy()
        nb = (n + BLOCK - 1) // BLOCK
        dt = {"fp32": F32, "bf16": np.uint16, "int8": None}[moments]
        if moments == "int8":
            self.m = np.zeros(n, np.int8) if m is None else m.view(np.int8).copy()
            self.v = np.zeros(n, np.uint8) if v is None else v.view(np.uint8).copy()
            self.ms = np.zeros(nb, F32) if ms is None else ms.copy()
            self.vs = np.zeros(nb, F32) if vs is None else vs.copy()
        else:
            self.m = np.zeros(n, dt) if m is None else m.view(dt).copy()
            self.v = np.zeros(n, dt) if v is None else v.view(dt).copy()
            self.ms = np.zeros(nb, F32)
            self.vs = np.zeros(nb, F32)

    def load(self):
        n = self.n
        blk = np.arange(n) // BLOCK
        if self.moments == "fp32":
            return self.m.astype(F32), self.v.astype(F32), self.v.astype(F32)
        if self.moments == "bf16":
            v = bf16_to_f32(self.v)
            return bf16_to_f32(self.m), v, v
        q = self.m.astype(np.int32)
        m = code_decode(q * np.abs(q), self.ms[blk], INV_QM2)
        qv = self.v.astype(np.int32)
        w = code_decode(qv * qv, self.vs[blk], INV_QV2)
        return m, (w * w).astype(F32), w

    def store(self, m, w, first, key_m, key_v):
        idx = (np.arange(self.n, dtype=np.uint64) + np.uint64(first)).astype(U32)
        if self.moments == "fp32":
            self.m, self.v = m.astype(F32), w.astype(F32)
            return
        if self.moments == "bf16":
            self.m = bf16_stochastic(m, round_bits(key_m, idx))
            self.v = bf16_stochastic(w, round_bits(key_v, idx))
            return
        for x, key, second in ((m, key_m, False), (w, key_v, True)):
            codes = np.zeros(self.n, np.int32)
            scales = np.zeros((self.n + BLOCK - 1) // BLOCK, F32)
            u = round_uniform(round_bits(key, idx))
            Q = QV if second else QM
            for b in range(scales.size):
                sl = slice(b * BLOCK, min(self.n, (b + 1) * BLOCK))
                a = np.abs(x[sl])
                bad = not np.all(a < F32(np.inf))
                smax = F32(0) if bad else (a.max() if a.size else F32(0))
                scales[b] = F32(np.nan) if bad else smax
                if bad or not smax > 0:
                    continue
                q = code_encode(grid_position(a, smax, Q), Q, u[sl])
                codes[sl] = q if second else np.where(x[sl] < 0, -q, q)
            if second:
                self.v, self.vs = codes.astype(np.uint8), scales
            else:
                self.m, self.ms = codes.astype(np.int8), scales


def update(st, grad, ranges, lr, b1, b2, eps, wd, gscale, group, t, first):
    k = step_consts(lr, b1, b2, eps, t)
    decay_on = F32(1) - F32(lr) * F32(wd)
    decay_off = F32(1) - F32(lr) * F32(0)
    upd = np.zeros(st.n, bool)
    decay = np.full(st.n, decay_off, F32)
    for b, e, d in ranges:
        upd[b:e] = True
        if d:
            decay[b:e] = decay_on
    m, v, w = st.load()
    if st.master == "split":
        p = split_join(st.hi, st.lo)
    else:
        p = st.p32.copy()
    with np.errstate(all="ignore"):
        g = grad.astype(F32) * F32(gscale)
        p2 = p * decay
        m2 = fma32(k["omb1"], g - m, m)
        v2 = fma32(k["omb2"], g * g, v * k["b2"])
        w2 = np.sqrt(v2)
        denom = w2 / k["bc2"] + k["eps"]
        p2 = fma32(k["neg_step"], m2 / denom, p2)
    m = np.where(upd, m2, m)
    v = np.where(upd, v2, v)
    w = np.where(upd, w2, w)
    if st.master == "split":
        st.hi = np.where(upd, split_hi(p2), st.hi).astype(np.uint16)
        st.lo = np.where(upd, split_lo(p2), st.lo).astype(np.int16)
    else:
        st.p32 = np.where(upd, p2, st.p32).astype(F32)
        st.hi = np.where(upd, bf16_rne(p2), st.hi).astype(np.uint16)
    key = round_key(group, t)
    st.store(m, w if st.moments == "int8" else v, first, key ^ KEY_M, key ^ KEY_V)


def wide(rng, n, lo, span):
    mag = 10.0 ** (lo + span * rng.random(n))
    x = np.where(rng.random(n) < 0.5, -mag, mag).astype(F32)
    r = rng.integers(0, 40, n)
    x[r == 0] = 0
    x[r == 1] = (np.float64(1e-40) * rng.integers(1, 100, (r == 1).sum())).astype(F32)  # denormals
    return x


def compare(name, got, want):
    g = np.ascontiguousarray(got).view(np.uint8).reshape(-1)
    w = np.ascontiguousarray(want).view(np.uint8).reshape(-1)
    if g.size != w.size:
        return f"{name}: {g.size} bytes from the engine, {w.size} from the reference"
    bad = np.nonzero(g != w)[0]
    if bad.size:
        e = bad[0] // want.itemsize
        return f"{name}: {bad.size} bytes differ, first at element {e}: engine {got.reshape(-1)[e]!r}, reference {want.reshape(-1)[e]!r}"
    return None


def case(tool, work, rng, moments, master, path, name, n, first, ranges, grads, init, **state):
    d = os.path.join(work, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "n.txt"), "w") as f:
        f.write(f"{n}\n")
    with open(os.path.join(d, "ranges.txt"), "w") as f:
        for b, e, dc in ranges:
            f.write(f"{b} {e} {int(dc)}\n")
    init.astype(F32).tofile(os.path.join(d, "master.f32"))
    for key in ("m", "v", "m_scale", "v_scale"):
        path_in = os.path.join(d, key + ".in")
        if os.path.exists(path_in):
            os.remove(path_in)
        if key in state:
            state[key].tofile(path_in)
    for t, g in enumerate(grads, 1):
        g.astype(F32).tofile(os.path.join(d, f"grad.{t}.f32"))
    lr, b1, b2, eps, wd, gs, group = 3e-3, 0.9, 0.999, 1e-8, 0.1, 0.8, 5
    args = [tool, d, moments, master, path, str(len(grads)), str(group), str(first), repr(lr), repr(b1), repr(b2),
            repr(eps), repr(wd), repr(gs)]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return f"the tool failed: {r.stderr.strip()}"
    st = State(moments, master, init, state.get("m"), state.get("m_scale"), state.get("v"), state.get("v_scale"))
    for t, g in enumerate(grads, 1):
        update(st, g, ranges, lr, b1, b2, eps, wd, gs, group, t, first)
    eb = {"fp32": F32, "bf16": np.uint16, "int8": np.int8}[moments]
    out = lambda key, dt, cnt: np.fromfile(os.path.join(d, key), dtype=dt, count=cnt)  # noqa: E731
    nb = (n + BLOCK - 1) // BLOCK
    checks = [("hi", out("hi.u16", np.uint16, n), st.hi)]
    if master == "split":
        checks.append(("remainder", out("master.out", np.int16, n), st.lo))
    else:
        checks.append(("master", out("master.out", F32, n), st.p32))
    checks.append(("m", out("m.out", eb, n), st.m.view(eb)))
    checks.append(("v", out("v.out", np.uint8 if moments == "int8" else eb, n), st.v))
    if moments == "int8":
        checks.append(("m scales", out("m_scale.out", F32, nb), st.ms))
        checks.append(("v scales", out("v_scale.out", F32, nb), st.vs))
    for what, got, want in checks:
        err = compare(what, got, want)
        if err:
            return err
    return None


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    tool = sys.argv[1]
    work = sys.argv[sys.argv.index("--work") + 1] if "--work" in sys.argv else tempfile.mkdtemp(prefix="optim-ref-")
    paths = subprocess.run([tool, "--paths"], capture_output=True, text=True, check=True).stdout.split()
    rng = np.random.default_rng(20261127)
    failures, count = 0, 0
    n = 7 * BLOCK + 53
    ranges = [(0, 700, True), (700, 1000, False), (1024, 1536, True), (1600, n, True)]
    for moments in ("bf16", "int8", "fp32"):
        for master in ("fp32", "split"):
            if moments == "fp32" and master == "fp32":
                continue
            init = wide(rng, n, -4, 4)
            init[:3] = [0.0, -0.0, 1e-41]
            grads = [wide(rng, n, -12, 12) for _ in range(4)]
            grads[1][1100] = 1e30  # one large value in a block
            grads[2][1700] = np.inf  # a non-finite gradient: its block's moments become NaN
            # A block of tiny gradients: scales below 1e-34, where Q^2 / s overflows.
            grads[0][256:512] = (wide(rng, 256, -2, 1) * F32(1e-37)).astype(F32)
            for path in paths:
                cases = [("plain", n, 0, ranges, grads, init, {})]
                if moments == "int8":
                    # Moments already in the format, one block with one huge scale.
                    m0 = rng.integers(-127, 128, n).astype(np.int8)
                    v0 = rng.integers(0, 256, n).astype(np.uint8)
                    ms0 = (10.0 ** rng.uniform(-8, -2, (n + BLOCK - 1) // BLOCK)).astype(F32)
                    vs0 = (10.0 ** rng.uniform(-6, -1, (n + BLOCK - 1) // BLOCK)).astype(F32)
                    ms0[2] = F32(1e20)
                    m0[:300] = 0
                    cases.append(("with-state", n, 4 * BLOCK, ranges, grads[:2], init,
                                  dict(m=m0, v=v0, m_scale=ms0, v_scale=vs0)))
                for cname, cn, first, rg, gs, ini, state in cases:
                    name = f"{moments}-{master}-{path}-{cname}"
                    err = case(tool, work, rng, moments, master, path, name, cn, first, rg, gs, ini, **state)
                    count += 1
                    if err:
                        failures += 1
                        print(f"FAIL {name}: {err}")
                    else:
                        print(f"ok   {name}")
    print(f"{count - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
