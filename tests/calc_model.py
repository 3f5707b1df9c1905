"""A tiny model that has memorised calculator use: ``7*8=`` -> ``<calc>7*8</calc>`` (turn 1), then, after the
environment's ``<result>56</result>``, ``56`` and EOS (turn 2). Multi-turn tests need a policy that emits the stop
string; an untrained model never does. A few seconds of supervised steps on four problems, one thread."""

import torch

from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir

PROBLEMS = {"3*4": 12, "7*8": 56, "12*5": 60, "9*9": 81}


def build_calc_model_dir(out_dir, steps: int = 60, spec: TinyModelSpec | None = None):
    """``spec``: the model's shape (default: the tiny model's; vLLM on CPU needs heads of 32 dims or more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine several threads make these small steps far slower
    try:
        torch.manual_seed(0)
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(tokenizer, spec or TinyModelSpec(seed=1))
        rows, starts = [], []
        for expression, value in PROBLEMS.items():
            prompt = tokenizer(f"{expression}=", add_special_tokens=False)["input_ids"]
            target = tokenizer(f"<calc>{expression}</calc><result>{value}</result>{value}",
                               add_special_tokens=False)["input_ids"]
            rows.append(prompt + target + [tokenizer.eos_token_id])
            starts.append(len(prompt))
        memorise(model, rows, starts, tokenizer.eos_token_id, steps)
        return save_model_dir(model, tokenizer, out_dir)
    finally:
        torch.set_num_threads(threads)


def memorise(model, rows: list[list[int]], starts: list[int], pad_id: int, steps: int, lr: float = 3e-3) -> None:
    """``steps`` full-batch AdamW steps on ``rows`` (padded with ``pad_id``), the loss on each row's tokens from
    ``starts[i]`` on; the model is left in eval mode."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    attention, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (row, start) in enumerate(zip(rows, starts)):
        ids[i, :len(row)], attention[i, :len(row)] = torch.tensor(row), 1
        labels[i, start:len(row)] = torch.tensor(row[start:])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
