"""Resumable stores: Ctrl-C during a fill keeps what is on disk, says so, and a rerun finishes."""

import json
import os
import signal

import numpy as np
import pytest

from paraflax.data.tokenizer import train_tokenizer
from paraflax.training.run.interrupt import Interrupted
from paraflax.training.stores import store


@pytest.mark.fast
def test_sigint_during_a_fill_keeps_the_written_batches_and_a_rerun_finishes(tmp_path, ctrl_c):
  out, meta = tmp_path / "store", {"examples": 10, "batch_size": 4}  # 3 batches
  shapes = {"rows": ((10, 2), (4, 2))}
  tok = train_tokenizer(["def f(x):\n  return x\n"] * 4, vocab_size=260)
  rows = np.arange(20, dtype=np.int32).reshape(10, 2)

  def make(i, lo, hi, interrupt_at=None):
    if i == interrupt_at:
      os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in the middle of batch i
    return {"rows": rows[lo:hi]}

  arrays, done = store.open_store(out, meta, shapes, tok, what="test store")
  with pytest.raises(Interrupted) as err:
    store.fill(out, arrays, meta, done, lambda *a: make(*a, interrupt_at=1), desc="t",
               progress=False)
  assert str(err.value) == (f"interrupted: 1 of 3 batches are kept in {out}; run the same "
                            "command again to resume")
  assert json.loads((out / store.PROGRESS).read_text()) == {"batches": 1}

  arrays, done = store.open_store(out, meta, shapes, tok, what="test store")
  assert done == 1
  store.fill(out, arrays, meta, done, make, desc="t", progress=False)
  _, read = store.read_store(out, ["rows"], what="test store", command="test")
  np.testing.assert_array_equal(read["rows"], rows)
