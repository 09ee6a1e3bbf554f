# One ctest test per unittest case (names without ';').
kvrelay_add_python_test("vllm stand-in: the driver replays vLLM's call order with exact KV" "test_standin")
kvrelay_add_python_test("vllm connector: the native and torch copy paths agree in every layout" "test_copy_paths")
# Skips (passes with nothing run) without a CUDA device; scripts/gpu-check.sh runs it where one is.
kvrelay_add_python_test("vllm connector: the GPU path hands CUDA caches over bit-exact" "test_gpu_path")
foreach(case IN ITEMS
        OneNode.test_publish_then_load_is_bit_exact_between_two_engine_processes_in_every_layout
        OneNode.test_the_torch_copy_path_on_host_tensors_moves_the_same_kv
        OneNode.test_the_last_prompt_token_is_recomputed_and_loads_are_whole_blocks
        OneNode.test_a_prompt_sharing_only_the_first_blocks_of_a_published_one_loads_those_blocks
        OneNode.test_kv_transfer_params_pass_through_and_a_chain_root_separates_tenants
        OneNode.test_a_load_that_fails_is_reported_and_recomputed_never_served_wrong
        OneNode.test_a_killed_sidecar_costs_vllm_nothing_but_the_hit_and_the_connector_reconnects
        OneNode.test_fp8_kv_caches_move_as_tagged_bytes_bit_exact
        OneNode.test_a_preempted_request_resolves_and_loads_again_when_it_resumes
        OneNode.test_a_stopped_sidecar_costs_each_call_its_deadline_and_the_connector_comes_back
        OneNode.test_tensor_parallel_ranks_publish_and_load_their_own_shards
        Asynchronous.test_async_lookups_answer_none_until_the_sidecar_decides_and_then_load
        Asynchronous.test_async_loads_land_through_get_finished_bit_exact
        Asynchronous.test_an_async_load_that_fails_is_reported_and_recomputed
        Asynchronous.test_a_request_aborted_while_its_load_runs_keeps_its_blocks_until_the_load_ends
        Configuration.test_block_tokens_must_divide_the_vllm_block_size
        Configuration.test_an_unknown_kv_cache_dtype_is_refused_by_name
        Configuration.test_unknown_settings_are_refused_by_name
        TwoNodes.test_kv_published_on_node_a_is_loaded_bit_exact_on_node_b_over_tcp
        TwoNodes.test_kv_prefetched_from_node_a_is_loaded_from_node_bs_own_store
        TwoNodes.test_tensor_parallel_shards_are_fetched_from_the_peer_by_the_schedulers_lookup)
  string(REGEX REPLACE "^[A-Za-z]+\\.test_" "" words "${case}")
  string(REPLACE "_" " " words "${words}")
  kvrelay_add_python_test("vllm connector: ${words}" "test_connector.${case}")
endforeach()
