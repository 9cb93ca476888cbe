"""A few Trainer steps of a LoRA on the tiny dev model, for the callback's tests (the same code as
docs/train-to-production.md's example, with the dataset made up on the spot)."""

from __future__ import annotations

from pathlib import Path


def toy_dataset(tokenizer, n: int, answer: str = "ahoy matey") -> list[dict]:
    rows = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"question {i}"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        input_ids = list(ids) + target
        labels = [-100] * len(ids) + target
        pad = 48 - len(input_ids)
        rows.append({"input_ids": input_ids + [tokenizer.pad_token_id] * pad,
                     "attention_mask": [1] * len(input_ids) + [0] * pad, "labels": labels + [-100] * pad})
    return rows


def train(base: Path, out: Path, callbacks: list, *, steps: int = 4, run_name: str = "toy-sft", seed: int = 0,
          save_steps: int | None = None):
    """`steps` optimizer steps of a rank-8 LoRA on q/v with an eval at the end; returns the trainer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=str(out), run_name=run_name, max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=steps, report_to="none",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True,
        disable_tqdm=True, seed=seed, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=toy_dataset(tokenizer, 16),
                      eval_dataset=toy_dataset(tokenizer, 4), callbacks=callbacks)
    trainer.train()
    return trainer
