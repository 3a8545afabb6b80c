"""TRL 1.16's ``GRPOTrainer._tool_call_loop`` with each round's tool calls run for all rollouts at once.

TRL's loop (``trl/trainer/grpo_trainer.py``, release 1.16.0, Apache-2.0)
calls the tools of rollout 0, then those of rollout 1, and so on: with remote
sandboxes a round costs the *sum* of the rollouts' command latencies. Here the
round's rollouts are handed to a thread pool together, so a round costs about
the *slowest* rollout. Everything else is TRL's code, unchanged:

- within a rollout, :func:`~shim.tool_dispatch.call_rollout_tools` is TRL's per-rollout body
  verbatim: its calls in order, sync results before async ones (the async
  ones gathered on TRL's own event loop), ``{"error": str(e)}`` results and
  the same call and failure counts;
- the messages are appended, token ids concatenated, overlong rounds rolled
  back, masks and logprobs extended in TRL's order, after the round's calls
  have all returned (:func:`tool_call_loop` below is TRL's method with only
  the calling block replaced).

Only TRL 1.16 is supported (:mod:`shim.trainer` checks the version): this
file is a copy of that release's loop, and a later release may change it.

For comparison, TRL's ``AsyncGRPOTrainer`` rollout worker already runs rollouts
concurrently on its event loop and sync tools on a ``ThreadPoolExecutor``
(``_tool_pool``, ``max_inflight_tasks`` workers; see
``async_rollout_worker._execute_tool_calls``), awaiting one rollout's calls one
after another; it needs none of this.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.chat_template_utils import parse_response
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from shim.tool_dispatch import (
    RolloutCalls,
    RolloutOutcome,
    call_rollout_tools,
    run_tool_round,
)

__all__ = ["RolloutCalls", "RolloutOutcome", "call_rollout_tools", "run_tool_round", "tool_call_loop"]

# The rest is TRL 1.16.0's GRPOTrainer._tool_call_loop with the calling block replaced
# (marked "harbor-async"); `self` is the trainer. Keep it in step with that release.


def tool_call_loop(  # TRL's own shape, kept for a line-by-line diff with its release
    self: Any, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
):
    """TRL 1.16's tool loop; each round's calls go through ``self._harbor_run_tool_round``."""
    # Tool execution loop: execute tools, then regenerate completions with tool results appended to the prompt
    tool_calls = [completion[0].get("tool_calls") for completion in completions]
    idxs_with_tool = [idx for idx, tool_call in enumerate(tool_calls) if tool_call]
    tool_calls = [tool_calls[idx] for idx in idxs_with_tool]
    tool_mask = [[1] * len(ids) for ids in completion_ids]  # 0 for tool result tokens, 1 elsewhere
    # Collect images from multimodal tool responses for the forward pass
    tool_images: list[list[Any]] = [[] for _ in completion_ids]
    tool_call_count = 0
    tool_failure_count = 0
    iteration_num = 0

    while idxs_with_tool and iteration_num < self.max_tool_calling_iterations:
        prompt_completion_tools = [prompts[i] for i in idxs_with_tool]  # select only prompts that need tool calls
        # Snapshot state so we can rollback tool results that would exceed max_completion_length
        completions_len_before = [len(completions[i]) for i in idxs_with_tool]
        tool_images_len_before = [len(tool_images[i]) for i in idxs_with_tool]
        prompts_len_before = [len(prompts[i]) for i in idxs_with_tool]

        # ── harbor-async: every rollout's calls of this round at once (TRL: one rollout after another) ──
        outcomes = self._harbor_run_tool_round(
            [
                (tool_calls[idx], self._sync_tool_dicts[idx_with_tool], self._async_tool_dicts[idx_with_tool])
                for idx, idx_with_tool in enumerate(idxs_with_tool)
            ]
        )
        # Build the new prompt for generation: TRL's bookkeeping, in TRL's order.
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            prompt_completion_tool = prompt_completion_tools[idx]
            # Append the last assistant message (which triggered tool_calls) to the prompt
            prompt_completion_tool.append(completions[idx_with_tool][-1])
            tool_call_results, calls, failures = outcomes[idx]
            tool_call_count += calls
            tool_failure_count += failures
            for name, result in tool_call_results:
                # Support multimodal tool responses: if the tool returns a list of content blocks
                # (e.g., [{"type": "image", "image": ...}, {"type": "text", "text": "..."}]),
                # pass them through directly so _tokenize_prompts can extract images for VLMs.
                content = result if isinstance(result, list) else str(result)
                tool_message = {"role": "tool", "name": name, "content": content}
                # Collect images from multimodal tool responses
                if isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and part.get("type") == "image":
                            tool_images[idx_with_tool].append(part["image"])
                prompt_completion_tool.append(tool_message)
                completions[idx_with_tool].append(tool_message)

        # Build token IDs by concatenation: prompt + completion + tool_suffix.
        prompt_completion_tool_ids = []
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            # Extract trailing tool messages from completions
            tool_messages: list[dict[str, Any]] = []
            for message in reversed(completions[idx_with_tool]):
                if message["role"] == "tool":
                    tool_messages.insert(0, message)
                else:
                    break
            suffix_ids = self._get_tool_suffix_ids(tool_messages)
            prompt_completion_tool_ids.append(prompt_ids[idx_with_tool] + completion_ids[idx_with_tool] + suffix_ids)

        # Drop tool results whose addition would push the sequence past max_completion_length (the completion
        # budget) or past the backend context ceiling (vLLM and transformers will error out on inputs longer than
        # the model's max length). The sample exits the loop with its completion as-is, and the tool
        # messages/images appended this iteration are rolled back so completions and tool_images stay consistent
        # with completion_ids.
        if self.use_vllm and self.vllm_mode == "colocate":
            max_model_len = self.vllm_generation.llm.llm_engine.model_config.max_model_len
        else:
            config = self.model.config.text_config if self._is_vlm else self.model.config
            max_model_len = config.max_position_embeddings
        overlong = [
            len(pct) - len(prompt_ids[i]) > self.max_completion_length or len(pct) >= max_model_len
            for i, pct in zip(idxs_with_tool, prompt_completion_tool_ids, strict=True)
        ]
        for idx in range(len(idxs_with_tool)):
            if overlong[idx]:
                idx_with_tool = idxs_with_tool[idx]
                del completions[idx_with_tool][completions_len_before[idx] :]
                del tool_images[idx_with_tool][tool_images_len_before[idx] :]
                del prompts[idx_with_tool][prompts_len_before[idx] :]
        # Keep only non-overlong items for further processing
        idxs_with_tool = [idx for idx, o in zip(idxs_with_tool, overlong, strict=True) if not o]
        prompt_completion_tool_ids = [pct for pct, o in zip(prompt_completion_tool_ids, overlong, strict=True) if not o]
        if not idxs_with_tool:
            break  # all overlong, exit tool loop

        # Filter images and multimodal fields to match the current subset (index into full batch).
        # Merge tool response images so the model can see visual feedback during generation.
        merged_images = images
        if any(imgs for imgs in tool_images):
            if merged_images is None:
                merged_images = [imgs if imgs else None for imgs in tool_images]
            else:
                merged_images = [
                    (existing or []) + new for existing, new in zip(merged_images, tool_images, strict=True)
                ]
        loop_images = [merged_images[i] for i in idxs_with_tool] if merged_images else None
        if self._is_vlm and self.tools and any(imgs for imgs in tool_images):
            flat_loop_images = [img for img_list in loop_images if img_list for img in img_list]  # type: ignore[union-attr]  # set: tool_images has images
            if flat_loop_images:
                image_inputs = self.processing_class.image_processor(images=flat_loop_images, return_tensors="pt")
                image_inputs = super(GRPOTrainer, self)._prepare_inputs(image_inputs)
                loop_multimodal_fields = dict(image_inputs)
            else:
                loop_multimodal_fields = {}
        elif multimodal_fields:
            if "num_images" not in multimodal_fields and images is not None:
                multimodal_fields = {
                    **multimodal_fields,
                    "num_images": [len(img_list) if img_list else 0 for img_list in images],
                }
            split_fields = split_pixel_values_by_grid(multimodal_fields)
            loop_multimodal_fields = {}
            for k, v in split_fields.items():
                selected: Any = [v[i] for i in idxs_with_tool]  # lists or tensors
                # Per-token type-id fields may arrive as tensors (e.g. via the padding workaround);
                # convert them to lists so they follow the same left-padding path as list-valued
                # per-token fields below, keeping them aligned with the left-padded input_ids.
                if k in ("token_type_ids", "mm_token_type_ids") and isinstance(selected[0], torch.Tensor):
                    selected = [s.tolist() for s in selected]
                # Per-token fields (e.g. token_type_ids) need zero-padding to match extended prompt length
                if isinstance(selected[0], list):
                    selected = [
                        s + [0] * (len(pct) - len(s))
                        for s, pct in zip(selected, prompt_completion_tool_ids, strict=True)
                    ]
                elif isinstance(v, torch.Tensor):
                    selected = torch.stack(selected)
                loop_multimodal_fields[k] = selected
            loop_multimodal_fields = unsplit_pixel_values_by_grid(loop_multimodal_fields)
            loop_multimodal_fields.pop("num_images", None)
            if "pixel_values" in loop_multimodal_fields and loop_multimodal_fields["pixel_values"].numel() == 0:
                for key in ["pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"]:
                    loop_multimodal_fields.pop(key, None)
        else:
            loop_multimodal_fields = {}

        # Generate new completions after tool execution (using concatenated IDs, no re-tokenization)
        post_tool_ids, post_tool_logprobs = self._generate_single_turn(
            prompt_completion_tool_ids,
            loop_images,
            loop_multimodal_fields,
            num_generations=1,  # each sample has its own history, so generate one completion per sample
            has_tool_images=any(imgs for imgs in tool_images),
        )

        # Truncate so that pct[len(prompt_ids[idx]) :] + post_tool does not exceed max_completion_length.
        # The pre-regen check guarantees len(completion_tool_ids) <= max_completion_length, so any
        # excess can only come from post_tool_ids. post_tool_ids is model-generated text and never
        # contains image tokens, so a plain slice is safe.
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            completion_tool_length = len(prompt_completion_tool_ids[idx]) - len(prompt_ids[idx_with_tool])
            excess_length = completion_tool_length + len(post_tool_ids[idx]) - self.max_completion_length
            if excess_length > 0:
                new_len = len(post_tool_ids[idx]) - excess_length
                post_tool_ids[idx] = post_tool_ids[idx][:new_len]
                if logprobs is not None:
                    post_tool_logprobs[idx] = post_tool_logprobs[idx][:new_len]

        # Update tool_mask: the tool result should be 0 and the post-tool 1
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            prompt_completion_tool_length = len(prompt_completion_tool_ids[idx])
            prompt_length = len(prompt_ids[idx_with_tool])
            completion_length = len(completion_ids[idx_with_tool])
            post_tool_length = len(post_tool_ids[idx])
            tool_length = prompt_completion_tool_length - prompt_length - completion_length
            tool_mask[idx_with_tool] += [0] * tool_length + [1] * post_tool_length
            if logprobs is not None:
                logprobs[idx_with_tool] += [0.0] * tool_length + post_tool_logprobs[idx]

        # Update completion_ids with the new completions (after tool execution)
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            prompt_length = len(prompt_ids[idx_with_tool])
            pct = prompt_completion_tool_ids[idx]  # = prompt-completion-tool
            completion_ids[idx_with_tool] = pct[prompt_length:] + post_tool_ids[idx]

        # Decode post-tool completions, each with the tools its prompt was rendered with
        if self.environment_factories is not None:
            per_prompt_tools = [self._env_tools[self._batch_environments[i]] for i in idxs_with_tool]
        else:
            per_prompt_tools = [self.tools] * len(idxs_with_tool)
        post_tool_completions = [
            parse_response(self._tokenizer, ids, prefix=prompt_completion_tool_ids[idx], tools=per_prompt_tools[idx])
            if ids
            else {}
            for idx, ids in enumerate(post_tool_ids)
        ]

        # Add post-tool completions to the existing completions
        for idx in range(len(idxs_with_tool)):
            idx_with_tool = idxs_with_tool[idx]
            if post_tool_completions[idx]:  # {} if post-tool completions completely truncated
                completions[idx_with_tool].append(post_tool_completions[idx])

        # Check for further tool calls
        tool_calls = [completion.get("tool_calls") for completion in post_tool_completions]
        idxs_with_tool = [idx for idx, tool_call in zip(idxs_with_tool, tool_calls, strict=True) if tool_call]
        tool_calls = [tool_call for tool_call in tool_calls if tool_call]
        iteration_num += 1

    return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images
