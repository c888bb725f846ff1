"""Chat-formatted prompt ids for the engine tests."""


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn with the generation prompt, tokenised by ``tokenizer``'s chat template."""
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out
