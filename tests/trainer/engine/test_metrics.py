"""A profiled step's HF generate records a bounded number of decode steps (trainer/engine/metrics.py DecodeWindow):
a realistic shape's whole generate would be millions of profiler events and a GPU check's minutes."""

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.config import TinyModelConfig
from trainer.engine.metrics import PROFILED_DECODE_STEPS, DecodeWindow
from trainer.engine.models import build_tokenizer, load_actor


def test_a_profiled_generate_records_the_first_decode_steps_only():
    tok = build_tokenizer()
    model = load_actor("tiny", tok, tiny=TinyModelConfig(), max_positions=128)
    ids = torch.randint(5, len(tok), (2, 8), generator=torch.Generator().manual_seed(0))
    new_tokens = 4 * PROFILED_DECODE_STEPS
    layers = model.config.num_hidden_layers

    def forwards(windowed: bool) -> int:
        """The decoder forwards the profiler recorded (one attention call per layer per forward)."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            window = DecodeWindow(prof, [ProfilerActivity.CPU]) if windowed else None
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=window)  # fmt: skip
            assert window is None or not window.paused  # collection resumed when the generate ended
            torch.ones(1).add_(1)  # recorded again after the window
        sdpa = sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())
        assert any(e.name == "aten::add_" for e in prof.events()), "nothing recorded after the generate"
        return sdpa // layers

    assert forwards(False) == new_tokens
    assert forwards(True) == PROFILED_DECODE_STEPS
