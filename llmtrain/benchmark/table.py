"""The table a benchmark run prints: its setting, device, tokens/s, step times, MFU, data wait, memory, load."""

from __future__ import annotations

import os

from llmtrain.benchmark.baseline import _lora_words


def _print_table(record: dict) -> None:
    ms = {key: record[key] * 1000 for key in record if key.startswith("step_time_")}
    logged = record["data_wait_fraction_logged"]
    lines = [
        ("setting", f"{_recipe_words(record)}{record['model']} ({_parameter_words(record)}) "
                    f"{record['precision']}, micro batch "
                    f"{record['micro_batch_size']} × seq {record['seq_len']}, {record['devices']} process(es)"
                    f"{' ' + record['sharding_strategy'] if record['sharding_strategy'] else ''}"
                    f"{' ' + record['strategy'] if record.get('strategy', 'auto') != 'auto' else ''}"
                    f"{_split_words(record)}, global batch {record['global_batch_size']}"
                    f"{', compiled' if record['compile'] else ''}"
                    f"{_checkpointing_words(record)}"),
        ("device", f"{record['device']}, {record['threads_per_process']} threads per process, torch {record['torch']}"),
        ("tokens/s per device", f"{record['tokens_per_sec_per_device']:,.0f} ({record['tokens_per_sec']:,.0f} in all)"),
        ("step time", f"median {ms['step_time_median_s']:.1f} ms, IQR {ms['step_time_p25_s']:.1f}–"
                      f"{ms['step_time_p75_s']:.1f}, min {ms['step_time_min_s']:.1f}, max "
                      f"{ms['step_time_max_s']:.1f} over {record['steps']} steps after {record['warmup']}"),
        ("matmul peak", f"{record['matmul_peak_flops'] / 1e9:,.1f} GFLOP/s (measured, n = "
                        f"{record['matmul_peak_size']})"),
        ("MFU", f"{record['mfu']:.1%} ({record['flops_per_token'] / 1e6:,.1f} MFLOP per token)"),
        ("waiting for data", f"{record['data_wait_fraction']:.2%} of step time"
                             + (f" (the loop's log: {logged:.2%})" if logged is not None else "")),
        ("peak memory", f"{record['peak_memory_gb']:.2f} GB"),
        *([("checkpoint stall", f"median {record['checkpoint_stall_s']:.3f} s, max "
                                f"{record['checkpoint_stall_max_s']:.3f} s over {record['checkpoint_saves']} "
                                f"{'asynchronous' if record['async_save'] else 'synchronous'} sharded saves")]
          if record["checkpoint_saves"] else []),
        ("load average", f"{record['load_average']} on {os.cpu_count()} cores"
                         + (" (other work ran alongside: noisy numbers)" if _busy(record) else "")),
    ]
    width = max(len(name) for name, _ in lines)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in lines))


def _parameter_words(record: dict) -> str:
    """"4.9M", or for a mixture of experts "10.8M, 4.9M active" (a record without the field counts all)."""
    total, active = record["parameters"], record.get("active_parameters", record["parameters"])
    return f"{total / 1e6:.1f}M" + (f", {active / 1e6:.1f}M active" if active != total else "")


def _recipe_words(record: dict) -> str:
    """"finetune_lora (r 8, ... ; 0.1M trainable) of " before the model, nothing for pretraining."""
    if record["recipe"] == "pretrain":
        return ""
    adapters = f"{_lora_words(record['lora'])}; " if record["lora"] else ""
    adapters += f"base {record['quantize']}; " if record.get("quantize") else ""
    return f"{record['recipe']} ({adapters}{record['trainable_parameters'] / 1e6:.2f}M trainable) of "


def _split_words(record: dict) -> str:
    """", tp 2, pp 2 (1f1b)" for a run that splits the model, else nothing."""
    words = [f"tp {record['tp_size']}"] if record["tp_size"] > 1 else []
    words += [f"pp {record['pp_size']} ({record['pp_schedule']})"] if record["pp_size"] > 1 else []
    return "".join(f", {word}" for word in words)


def _busy(record: dict) -> bool:
    """More runnable work than cores at the end (this run's own threads included) means it shared them."""
    return record["load_average"] is not None and record["load_average"] > (os.cpu_count() or 1) + 0.5


def _checkpointing_words(record: dict) -> str:
    mode = record.get("activation_checkpointing")
    return f", activation checkpointing {mode}" if mode else ""

