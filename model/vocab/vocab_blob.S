/* The built-in GPT-2 byte-level BPE vocabulary, linked into the program as bytes.
   Symbols: pd_vocab_encoder_json[_end] (vocab.json) and pd_vocab_merges_txt[_end]. */
    .section .rodata
    .global pd_vocab_encoder_json
    .global pd_vocab_encoder_json_end
    .global pd_vocab_merges_txt
    .global pd_vocab_merges_txt_end
pd_vocab_encoder_json:
    .incbin PD_VOCAB_ENCODER
pd_vocab_encoder_json_end:
    .byte 0
pd_vocab_merges_txt:
    .incbin PD_VOCAB_MERGES
pd_vocab_merges_txt_end:
    .byte 0
    .section .note.GNU-stack,"",@progbits
