# family overrides for the real-target table (source me)
FAM_dflash=""
FAM_dflash2="model.conv_kernel_size=2 model.conv_group_size=16 model.selector_rank=64 model.selector_top_k=16 loss.selector_alpha=1.0"
FAM_dspark="model.sample_from_anchor=true model.markov_rank=64 model.markov_head_type=vanilla model.confidence_head=true model.confidence_head_with_markov=true loss.confidence_alpha=1.0"
FAM_lilicorr="model.lilicorr_candidate_topk=8 model.lilicorr_hidden_size=192 model.lilicorr_num_heads=4"
