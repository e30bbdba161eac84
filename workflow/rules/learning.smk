# Learning stages: train_encoder (graph encoder on the rollouts' graphs -> results/<model>/encoder/) and train_world_model
# (MDN-RNN on the encoder's z sequences -> results/<model>/world_model/). Reward settings are NOT inputs.
# Code: src/rlflow/stages/train_encoder.py, src/rlflow/stages/train_world_model.py; the networks: src/rlflow/nn/,
# the training loops: src/rlflow/agents/. Paths, command line and config keys: STAGES[...] in
# src/rlflow/pipeline/registry.py.


rule train_encoder:
    input:
        unpack(stage_input("train_encoder")),
    output:
        **stage_output("train_encoder"),
    params:
        **stage_params("train_encoder"),
    log:
        stage_log("train_encoder"),
    benchmark:
        stage_benchmark("train_encoder")
    priority: stage_priority("train_encoder")
    conda:
        stage_conda("train_encoder")
    shell:
        stage_shell("train_encoder")


rule train_world_model:
    input:
        unpack(stage_input("train_world_model")),
    output:
        **stage_output("train_world_model"),
    params:
        **stage_params("train_world_model"),
    log:
        stage_log("train_world_model"),
    benchmark:
        stage_benchmark("train_world_model")
    priority: stage_priority("train_world_model")
    conda:
        stage_conda("train_world_model")
    shell:
        stage_shell("train_world_model")


# Stages train_controller (PPO in the dream only, then one real run -> results/<model>/controller/) and
# train_model_free (PPO on the real env -> results/<model>/model_free/). These two read env.reward; changing a
# reward parameter or the temperature reruns them and nothing upstream.


rule train_controller:
    input:
        unpack(stage_input("train_controller")),
    output:
        **stage_output("train_controller"),
    params:
        **stage_params("train_controller"),
    log:
        stage_log("train_controller"),
    benchmark:
        stage_benchmark("train_controller")
    priority: stage_priority("train_controller")
    conda:
        stage_conda("train_controller")
    shell:
        stage_shell("train_controller")


rule train_model_free:
    input:
        unpack(stage_input("train_model_free")),
    output:
        **stage_output("train_model_free"),
    params:
        **stage_params("train_model_free"),
    log:
        stage_log("train_model_free"),
    benchmark:
        stage_benchmark("train_model_free")
    priority: stage_priority("train_model_free")
    conda:
        stage_conda("train_model_free")
    shell:
        stage_shell("train_model_free")


# Sweeps (config `sweeps`): one train_controller job per temperature (RLFlow's Table 3) and per reward function
# (Fig. 5), each with that one config key fixed, in results/<model>/controller/temperature-<tau>/ and .../reward-<name>/.
# Code: src/rlflow/stages/train_controller.py (the same as train_controller).


rule sweep_temperature:
    input:
        unpack(stage_input("sweep_temperature")),
    output:
        **stage_output("sweep_temperature"),
    params:
        **stage_params("sweep_temperature"),
    log:
        stage_log("sweep_temperature"),
    benchmark:
        stage_benchmark("sweep_temperature")
    priority: stage_priority("sweep_temperature")
    conda:
        stage_conda("sweep_temperature")
    shell:
        stage_shell("sweep_temperature")


rule sweep_reward:
    input:
        unpack(stage_input("sweep_reward")),
    output:
        **stage_output("sweep_reward"),
    params:
        **stage_params("sweep_reward"),
    log:
        stage_log("sweep_reward"),
    benchmark:
        stage_benchmark("sweep_reward")
    priority: stage_priority("sweep_reward")
    conda:
        stage_conda("sweep_reward")
    shell:
        stage_shell("sweep_reward")
