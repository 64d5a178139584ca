"""torch.ops.spind.row_topk, the engine's top-k over each row's valid prefix
(kernels/include/spin/row_topk.h): the CPU reference against a brute force in torch, bad inputs,
and (on a GPU) the CUDA kernel equal to the CPU reference index for index.

Run by CTest (label python) with PYTHONPATH=<build>/python."""
import unittest

import torch

import spind

ops = spind.ops


def brute(logits, lens, k):
    """Indices of the k best of each row's prefix: by value (NaN lowest), ties to the lower
    index, ascending; -1 padding."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        n = max(0, min(int(lens[r]), logits.shape[1]))
        vals = logits[r, :n].tolist()
        keyed = sorted(range(n), key=lambda i: (float("-inf") if vals[i] != vals[i] else vals[i],
                                                -i), reverse=True)
        # NaN below -inf: order NaNs after every number.
        nums = [i for i in keyed if vals[i] == vals[i]]
        nans = sorted(i for i in range(n) if vals[i] != vals[i])
        chosen = sorted((nums + nans)[:k])
        out[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def cases(gen):
    """Rows that exercise the selection: random, heavy ties, NaN and infinities, short rows."""
    rows, width = 12, 3000
    x = torch.randn(rows, width, generator=gen)
    x[1] = torch.round(x[1] * 2) / 2          # many ties at the threshold
    x[2] = 1.0                                # all equal: the first k indices
    x[3, ::7] = float("nan")
    x[3, 5::11] = float("inf")
    x[3, 9::13] = float("-inf")
    x[4] = -torch.rand(width, generator=gen)  # all negative
    x[5, :] = float("nan")                    # only NaN
    x[6] = torch.arange(width, dtype=torch.float32)
    lens = torch.tensor([width, width, width, width, 2500, width, width,
                         0, 300, 257, 256, width + 50], dtype=torch.int32)
    lens[8] = -4
    return x, lens


class RowTopKCpu(unittest.TestCase):
    def test_matches_brute_force(self):
        gen = torch.Generator().manual_seed(3)
        x, lens = cases(gen)
        for k in (1, 17, 256, 1024):
            out = torch.empty(x.shape[0], k + 3, dtype=torch.int32).fill_(99)
            ops.row_topk(x, lens, k, out)
            self.assertTrue(torch.equal(out[:, :k], brute(x, lens, k)), f"k={k}")
            self.assertTrue(bool((out[:, k:] == 99).all()), "columns past k untouched")

    def test_bad_inputs_are_refused(self):
        x = torch.zeros(4, 64)
        lens = torch.full((4,), 64, dtype=torch.int32)
        out = torch.zeros(4, 8, dtype=torch.int32)
        bad = [
            ((x.double(), lens, 8, out), "logits must be float32"),
            ((x, lens.long(), 8, out), "lens must be contiguous int32"),
            ((x, lens[:3], 8, out), "lens must be contiguous int32"),
            ((x, lens, 9, out), "out must be int32 \\[rows, >= k\\]"),
            ((x, lens, 0, out[:, :0]), "k 0 outside"),
            ((x[:, ::2], lens, 8, out), "logits must be float32 .* unit column stride"),
        ]
        for args, msg in bad:
            before = out.clone()
            with self.assertRaisesRegex(RuntimeError, "spind.row_topk: " + msg):
                ops.row_topk(*args)
            self.assertTrue(torch.equal(out, before), msg)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class RowTopKCuda(unittest.TestCase):
    def test_equals_the_cpu_reference(self):
        gen = torch.Generator().manual_seed(5)
        x, lens = cases(gen)
        big = torch.randn(64, 131072, generator=gen)
        big_lens = torch.randint(60000, 131073, (64,), generator=gen, dtype=torch.int32)
        for xs, ls in ((x, lens), (big, big_lens)):
            for k in (1, 256, 2048):
                if k > 2048:
                    continue
                ref = torch.empty(xs.shape[0], k, dtype=torch.int32)
                ops.row_topk(xs, ls, k, ref)
                got = torch.empty(xs.shape[0], k, dtype=torch.int32, device="cuda")
                ops.row_topk(xs.cuda(), ls.cuda(), k, got)
                self.assertTrue(torch.equal(got.cpu(), ref), f"k={k} width={xs.shape[1]}")


if __name__ == "__main__":
    unittest.main()
