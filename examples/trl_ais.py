"""AIS inside TRL on a CPU, end to end: FP8 rollouts from an aisrl copy of the policy, AIS-corrected GRPO.

    pip install 'aisrl[trl]'
    python examples/trl_ais.py            # ~10 s: 4 steps of a tiny Llama, prints alpha and the diagnostics

Swap in your own model, tokenizer, dataset (a "prompt" column) and reward functions; everything else is
`trl.GRPOConfig` as usual. On a GPU with vLLM, drop `rollout_quant` and set `use_vllm=True` instead (see
docs/integrations.md for the FP8 vLLM recipe).
"""

import os

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from aisrl.integrations.trl import AISGRPOTrainer  # noqa: E402
from aisrl.models import tiny_model, word_tokenizer  # noqa: E402

# A word-level tokenizer (w0 .. w28) and a randomly initialised 2-layer Llama: no downloads.
tokenizer = word_tokenizer(29)
model = tiny_model("tiny-llama", vocab_size=32, hidden=64, layers=2)
dataset = Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 20)]})


def reward_w7(prompts, completions, **kwargs):
    """Toy verifiable reward: how often the completion says w7."""
    return [float(c.split().count("w7")) for c in completions]


args = GRPOConfig(output_dir="runs/trl_example", use_cpu=True, bf16=False, gradient_checkpointing=False,
                  per_device_train_batch_size=16, num_generations=4, max_completion_length=8, max_steps=4,
                  learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0)  # fmt: skip
trainer = AISGRPOTrainer(model=model, reward_funcs=reward_w7, args=args, train_dataset=dataset,
                         processing_class=tokenizer, correction="ais", correction_options={"cap": 2.0},
                         rollout_quant="fp8_e4m3_w8a8")  # fmt: skip
trainer.train()
for row in trainer.state.log_history:
    if "aisrl/alpha" in row:
        print(f"step {row['step']}: reward {row['reward']:.3f}  alpha {row['aisrl/alpha']:.3f}  "
              f"k3 KL {row['aisrl/k3_kl']:.2e}  ESS/N {row['aisrl/ess']:.3f}  "
              f"reliability {row['aisrl/weight_reliability']:.3f}")  # fmt: skip
