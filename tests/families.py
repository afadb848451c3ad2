"""Tiny random models of each family the tests cover, written as a model folder (config, weights, tokenizer) that
--model loads: ``AutoConfig.for_model`` -> ``AutoModel.from_config`` -> ``save_pretrained``, a pretrained body whose
classification head (and DeBERTa's pooler) a run makes fresh,
with a word-level tokenizer over the demo's words whose special tokens copy the real family's (GPT-2 and Llama have
no pad token; Qwen2's tokenizer pads with its end-of-text token, which its config does not name)."""

from pathlib import Path

from data.demo import FILLER, NEGATIVE, POSITIVE

WIDTH = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 128}
DECODER = {**WIDTH, "num_key_value_heads": 1, "tie_word_embeddings": False}
# family -> (config sizes, special tokens in id order, the tokenizer's roles for them, template around a text, pair)
FAMILIES = {
    "bert": (WIDTH, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
             {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
              "mask_token": "[MASK]"}, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "roberta": ({**WIDTH, "max_position_embeddings": 130, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
                ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                 "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>"}, "<s> $A </s>",
                "<s> $A </s> </s> $B </s>"),
    "distilbert": ({"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 128},
                   ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                   {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]"),
    "deberta-v2": ({**WIDTH, "pad_token_id": 0, "relative_attention": True, "position_buckets": 16,
                    "pos_att_type": ["p2c", "c2p"], "max_relative_positions": -1, "position_biased_input": False},
                   ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"],
                   {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "modernbert": ({**WIDTH, "global_attn_every_n_layers": 2, "local_attention": 16, "pad_token_id": 3,
                    "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2},
                   ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
                   {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                    "mask_token": "[MASK]"}, "[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]"),
    "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0},
             ["<|endoftext|>"], {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                 "unk_token": "<|endoftext|>"}, None, None),
    "llama": ({**DECODER, "bos_token_id": 1, "eos_token_id": 2}, ["<unk>", "<s>", "</s>"],
              {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, "<s> $A", "<s> $A <s> $B"),
    "qwen2": ({**DECODER, "bos_token_id": 0, "eos_token_id": 0}, ["<|endoftext|>"],
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, None, None),
    "t5": ({"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2, "pad_token_id": 0,
            "eos_token_id": 1, "decoder_start_token_id": 0}, ["<pad>", "</s>", "<unk>"],
           {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}, "$A </s>", "$A </s> $B </s>"),
    "bart": ({"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
              "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
              "max_position_embeddings": 128, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
              "decoder_start_token_id": 2, "forced_eos_token_id": 2}, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
             {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
              "cls_token": "<s>", "sep_token": "</s>", "mask_token": "<mask>"}, "<s> $A </s>",
             "<s> $A </s> </s> $B </s>"),
}


def write_family_model(family: str, folder: Path, padding_side: str = "right", seed: int = 0) -> Path:
    """A random ``family`` body and its tokenizer in ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoConfig, AutoModel, PreTrainedTokenizerFast

    sizes, special, roles, single, pair = FAMILIES[family]
    if family == "qwen2":  # transformers rebuilds Qwen2's tokenizer as byte-level BPE from the file's vocabulary
        vocab = {token: i for i, token in enumerate(special + sorted(pre_tokenizers.ByteLevel.alphabet()))}
        backend = Tokenizer(models.BPE(vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        vocab = {token: i for i, token in enumerate(special + sorted(set(POSITIVE + NEGATIVE + FILLER)))}
        backend = Tokenizer(models.WordLevel(vocab, unk_token=roles["unk_token"]))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if single:
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(token, vocab[token]) for token in special
                                                      if token in single + pair])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=128, padding_side=padding_side,
                                        **roles)
    config = AutoConfig.for_model(family, vocab_size=len(vocab), **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModel.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
