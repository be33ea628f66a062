import re

import pytest
import torch

from lopd import latent
from lopd.rollout import SamplingParams, TransformersEngine

N_LATENT = 4
KNOWN = [40, 41, 42, 43]      # ordinary tokens whose embeddings stand in for latents


def _prompts(tokenizer):
    users = ["Cancel order O12.", "Refill prescription R7 of patient P3 please, today.", "Hold S1."]
    return [tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": u}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for u in users]


def _pair(tokenizer):
    """The same prompts with a latent block, and with the known tokens in place of the sentinels."""
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    with_latents, plain = [], []
    for ids in _prompts(tokenizer):
        block = fmt.latent_block(N_LATENT)
        new, at = latent.insert_reference(ids, block, fmt)
        with_latents.append(new)
        known = list(block)
        known[len(fmt.prefix):len(fmt.prefix) + N_LATENT] = KNOWN
        plain.append(latent.insert_reference(ids, known, fmt)[0])
    return fmt, with_latents, plain


def _left_pad(seqs, pad):
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def test_reference_block_sits_at_the_start_of_the_first_user_message(tiny_tokenizer):
    fmt, with_latents, _ = _pair(tiny_tokenizer)
    text = tiny_tokenizer.decode(with_latents[0])
    assert ("<|im_start|>user\n" + latent.REFERENCE_PREFIX + "<|latent|>" * N_LATENT
            + latent.REFERENCE_SUFFIX + "Cancel order O12.<|im_end|>") in text
    assert text.startswith("<|im_start|>system\nYou are an agent.<|im_end|>\n")


def test_splicing_known_embeddings_reproduces_the_plain_run(tiny_tokenizer, tiny_model):
    fmt, with_latents, plain = _pair(tiny_tokenizer)
    embedding = tiny_model.get_input_embeddings()
    latents = embedding(torch.tensor([KNOWN] * len(plain))).detach()
    ids_l, mask = _left_pad(with_latents, tiny_tokenizer.pad_token_id)
    ids_p, mask_p = _left_pad(plain, tiny_tokenizer.pad_token_id)
    assert torch.equal(mask, mask_p)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = tiny_model(input_ids=ids_p, attention_mask=mask, position_ids=position_ids).logits
        spliced = latent.splice_embeddings(embedding, ids_l, latents, fmt.latent_id)
        out = tiny_model(inputs_embeds=spliced, attention_mask=mask, position_ids=position_ids).logits
    real = mask.bool()
    diff = (ref.log_softmax(-1) - out.log_softmax(-1))[real].abs().max().item()
    assert diff < 1e-5

    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    a = engine.generate(plain, params)
    b = engine.generate(with_latents, params, latents=latents)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5


def test_gradients_reach_the_latents(tiny_tokenizer, tiny_model):
    fmt, with_latents, _ = _pair(tiny_tokenizer)
    ids, mask = _left_pad(with_latents, tiny_tokenizer.pad_token_id)
    latents = torch.randn(len(with_latents), N_LATENT, tiny_model.config.hidden_size, requires_grad=True)
    embeds = latent.splice_embeddings(tiny_model.get_input_embeddings(), ids, latents, fmt.latent_id)
    tiny_model(inputs_embeds=embeds, attention_mask=mask).logits.sum().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0
    tiny_model.zero_grad(set_to_none=True)


def test_wrong_latent_count_is_a_clear_error(tiny_tokenizer, tiny_model):
    fmt, with_latents, _ = _pair(tiny_tokenizer)
    ids, _ = _left_pad(with_latents, tiny_tokenizer.pad_token_id)
    embedding, width = tiny_model.get_input_embeddings(), tiny_model.config.hidden_size
    with pytest.raises(ValueError, match=re.escape(
            "every row needs 5 <|latent|> tokens (its reference block); rows have [4, 4, 4]")):
        latent.splice_embeddings(embedding, ids, torch.zeros(len(with_latents), 5, width),
                                 fmt.latent_id)
    uneven = ids.clone()
    uneven[1, (uneven[1] == fmt.latent_id).nonzero()[0]] = KNOWN[0]     # one sentinel fewer
    with pytest.raises(ValueError, match=re.escape(
            "every row needs 4 <|latent|> tokens (its reference block); rows have [4, 3, 4]")):
        latent.splice_embeddings(embedding, uneven, torch.zeros(len(with_latents), 4, width),
                                 fmt.latent_id)
    with pytest.raises(ValueError, match=re.escape(
            f"latents must be (batch=3, n, d), got (2, 4, {width})")):
        latent.splice_embeddings(embedding, ids, torch.zeros(2, 4, width), fmt.latent_id)


def test_a_sentinel_the_model_sampled_after_the_block_keeps_its_embedding(tiny_tokenizer,
                                                                          tiny_model):
    """A rollout whose own tokens include the sentinel id (a small model can sample it): the
    block's first n sentinels take the latents, the sampled one stays the token's embedding."""
    fmt, with_latents, _ = _pair(tiny_tokenizer)
    ids, _ = _left_pad(with_latents, tiny_tokenizer.pad_token_id)
    ids[0, -1] = fmt.latent_id                       # the last generated token of row 0
    embedding = tiny_model.get_input_embeddings()
    latents = torch.randn(len(with_latents), N_LATENT, tiny_model.config.hidden_size)
    with torch.no_grad():
        spliced = latent.splice_embeddings(embedding, ids, latents, fmt.latent_id)
        plain = embedding(ids)
    block = (ids[0] == fmt.latent_id).nonzero().flatten()[:N_LATENT]
    assert torch.equal(spliced[0, block], latents[0])
    assert torch.equal(spliced[0, -1], plain[0, -1])
    others = torch.ones(ids.size(1), dtype=torch.bool)
    others[block] = False
    assert torch.equal(spliced[0, others], plain[0, others])


def test_shift_after_and_missing_header():
    assert latent.shift_after([1, 2, 3], 1, 2, 0) == [1, 0, 0, 2, 3]
    fmt = latent.ReferenceFormat(header=(9, 9), prefix=(), suffix=(), latent_id=5)
    with pytest.raises(ValueError, match="no user message header"):
        latent.insert_reference([1, 2, 3], [5], fmt)
