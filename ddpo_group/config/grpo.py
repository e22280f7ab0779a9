"""Named experiment configurations. Pick one with `--config config/grpo.py:NAME` (a checkout) or
`ddpo-group-train --config NAME` (any directory, installed or not). Each variant is a function in the module of
ddpo_group/config/variants/ that holds its purpose (tiny.py, sd.py, flow.py, tasks.py, video_edit.py; the package
docstring says which holds what); this file assembles them into VARIANTS, in the order --help lists them, and is
their map. A variant is read against the ones it derives from (tiny_* from tiny, the task presets from sd35):

    sd15            GRPO + reference KL on Stable Diffusion 1.5 with LoRA (config/grpo.py without :NAME; needs a GPU, the hub)
    ddpo            ddpo-pytorch's algorithm and defaults on SD 1.5: PPO on all steps, per-prompt stat tracking
    group_ppo       Group-PPO on SD 1.5 in the design that learns on the shapes task (docs/group_ppo.md); unmeasured on SD 1.5
    group_ppo_alg2  Group-PPO on SD 1.5 exactly as Algorithm 2 is written: noise at every step, endpoints trained
    tiny            GRPO on the shipped shapes-world model's 18 big-square prompts, CPU, minutes (the README's main run)
    tiny_squares    the same on all 36 square prompts
    tiny_all        GRPO on all 108 shapes-world prompts (slower to show learning)
    tiny_one_prompt GRPO on a single prompt the shapes-world model gets wrong: a visible rise in 2 minutes
    tiny_ddpo       the main job with DDPO (per-prompt stat tracking, no dual clip, no KL) instead of GRPO + KL
    tiny_group_ppo  Group-PPO on the main job's task: noise and training at the segment's first step, per-prompt baseline, KL
    tiny_group_ppo_alg2  Group-PPO on the main job's task as Algorithm 2 is written (its reward falls; docs/group_ppo.md)
    tiny_gae        the main job with a critic and GAE advantages over the steps instead of GRPO's group baseline
    tiny_nft        DiffusionNFT (forward process, no log-probs) on the main job's task and evaluation
    tiny_awm        advantage-weighted matching (forward process, PPO ratio of matching losses) on the main job's task
    tiny_dppo       the main job with Flow-DPPO's loss: a trust region on each step's exact KL to pi_old's, no ratio clip
    tiny_grpo_guard the main job with GRPO-Guard's loss: the clip on a per-step normalised ratio, 1/dt step weights
    tiny_dgpo       DGPO (group preferences on the matching loss against a frozen reference) on the main job's task
    tiny_dpo        Diffusion-DPO with online pairs (each group's best and worst) on the main job's task
    tiny_group_ppo_sampled  tiny_group_ppo_alg2 training one random step per segment (weighted) instead of its endpoint
    tiny_early_window  the main job trained only at the 2 noisiest steps (Flow-GRPO-Fast / MixGRPO style)
    tiny_window4    the main job with noise and training in a 4-step SDE window, lr 5e-5 (issue 35's best critic-free arm)
    tiny_hacking    reward hacking on show: trains on JPEG incompressibility, watches shapes_alignment (gold)
    test            the random-weight tiny pipeline, a few seconds; for tests and smoke checks
    sd35            GRPO + KL on SD3.5-Medium (flow matching, SDE steps) with Flow-GRPO's settings, one GPU
    flux            GRPO + KL on FLUX.1-dev (flow matching, SDE steps), bf16, LoRA, one GPU
    sd35_nft        DiffusionNFT on SD3.5-Medium with the paper's settings (CFG-free, deterministic sampler), one GPU
    tiny_sd3        a random-weight tiny SD3 pipeline (flow matching), seconds; tests and smoke checks
    tiny_sd3_dppo, tiny_sd3_grpo_guard  tiny_sd3 with the dppo / grpo_guard policy loss; tests and smoke checks
    tiny_sd3_dgpo   tiny_sd3 trained with DGPO on flow-ODE samples, seconds
    tiny_sd3_dpo    tiny_sd3 trained with Diffusion-DPO's online pairs, seconds
    tiny_sd_flow    a random-weight tiny SD UNet stepped by flow matching (the sd_flow family), seconds; tests
    tiny_flux       a random-weight tiny FLUX pipeline (flow matching), seconds; tests and smoke checks
    qwen_image      GRPO on Qwen-Image (flow matching, true CFG) with LoRA r64, Flow-Factory / verl settings, one GPU
    tiny_qwen_image  a random-weight tiny Qwen-Image pipeline (Qwen2.5-VL text, true CFG), seconds; tests and smoke checks
    sd35_ocr        Flow-GRPO's OCR (text rendering) recipe on SD3.5-Medium: the `ocr` reward (PaddleOCR), one GPU
    wan21_t2v_1_3b  GRPO + KL on Wan 2.1 T2V 1.3B (text-to-video, 33 frames) with Flow-GRPO's Wan settings, one GPU
    wan21_t2v_14b   GRPO on Wan 2.1 T2V 14B (5 frames, 10 steps) with Flow-Factory's Wan 2.1 T2V settings, LoRA
    tiny_wan        a random-weight tiny Wan pipeline (UMT5 text, videos of 5 frames), seconds; tests and smoke checks
    wan22_a14b_t2v  GRPO on Wan 2.2 T2V A14B (two experts, both trained) with Flow-Factory's Wan 2.2 T2V LoRA recipe
    wan21_i2v       GRPO on Wan 2.1 I2V 14B (image-to-video: source_image is the first frame) with Flow-Factory's recipe
    wan22_i2v       GRPO on Wan 2.2 I2V A14B (image-to-video, the high-noise expert trained) with Flow-Factory's recipe
    tiny_wan22_moe  a random-weight tiny Wan 2.2 A14B (two experts, CFG 4.5 then 3.0), seconds; tests and smoke checks
    tiny_wan_i2v    a random-weight tiny Wan 2.1 I2V (the first frame from source_image), seconds; tests and smoke checks
    tiny_wan22_i2v  tiny_wan_i2v with two experts (Wan 2.2 A14B I2V), the high-noise one trained, seconds
    sd35_pickscore  SD3.5-Medium with Flow-GRPO's PickScore settings (PickScore / 26 on its prompt set, KL 0.01), one GPU
    sdxl            GRPO + KL on SDXL 1.0 base (DDIM, two text encoders, pooled embeddings, time ids) with LoRA, one GPU
    tiny_sdxl       a random-weight tiny SDXL pipeline, seconds; tests and smoke checks
    flux_kontext    GRPO image editing on FLUX.1 Kontext [dev] with Flow-Factory's settings, LoRA r64, one GPU
    tiny_flux_kontext  a random-weight tiny FLUX.1 Kontext editing the shipped shapes-world sources, seconds
    qwen_image_edit GRPO image editing on Qwen-Image-Edit (true CFG 4) with Flow-Factory's settings, LoRA r64, one GPU
    tiny_qwen_image_edit  a random-weight tiny Qwen-Image-Edit editing the shipped shapes-world sources, seconds
    tiny_geneval    the main job's model and method trained with the geneval reward (exact shapes detector), CPU, minutes
    tiny_scenes     the second main job: Flow-GRPO's GenEval recipe on the shipped flow model tiny-scenes-sd3 (1-4 shapes
                    per 64-px scene, GenEval's six tags), evaluated on the held-out geneval_scenes.jsonl, CPU, minutes
    tiny_scenes_sd  the same task and evaluation on the shipped UNet + DDIM scenes model tiny-scenes (GRPO + KL)
    tiny_scenes_flow  tiny_scenes's Flow-GRPO recipe and task on the shipped flow-matching UNet tiny-scenes-flow
    tiny_scenes_flow_nft  the same task on tiny-scenes-flow with the scenes ladder's DiffusionNFT + KL recipe
    sd35_geneval    Flow-GRPO's GenEval recipe on SD3.5-Medium: the geneval reward (partial score), generated prompts
    sd35_nft_geneval  DiffusionNFT's GenEval recipe on SD3.5-Medium (sd35_nft with the geneval reward)
    flux2           FLUX.2 [dev] (32B) with Flow-Factory's GRPO LoRA recipe, one GPU (docs/flux2_zimage.md)
    flux2_klein     FLUX.2 [klein] 9B (step-distilled, 4 steps) with Flow-Factory's GRPO LoRA recipe, one GPU
    zimage          Z-Image (6B) with Flow-Factory's GRPO LoRA recipe, one GPU
    zimage_turbo    Z-Image-Turbo: 8 steps, no CFG, SDE steps 1-3, no KL (Flow-Factory's recipe), one GPU
    tiny_flux2      a random-weight tiny FLUX.2 [dev] (tiny Mistral-3 in memory), seconds; tests and smoke runs
    tiny_flux2_klein  a random-weight tiny FLUX.2 [klein] (tiny Qwen3 in memory, true CFG), seconds
    tiny_zimage     a random-weight tiny Z-Image (tiny Qwen3 in memory, CFG), seconds; tests and smoke runs
    tiny_zimage_turbo  zimage_turbo's sampling and KL on the random-weight tiny Z-Image, seconds
    qwen_image_edit_plus  GRPO multi-image editing on Qwen-Image-Edit-2509 with Flow-Factory's settings, LoRA r64
    tiny_qwen_image_edit_plus  a random-weight tiny Qwen-Image-Edit-2509 editing two shipped sources per prompt
    sana_nft        DiffusionNFT on SANA 1.5 1.6B (1024 px, CFG-free, Euler ODE sampler) with the paper's settings
    tiny_sana       a random-weight tiny SANA pipeline (Gemma-2 text, DC-AE, linear-attention DiT), seconds
    tiny_hunyuan_video15  a random-weight tiny HunyuanVideo 1.5 text-to-video pipeline, 5 frames, seconds
    tiny_hunyuan_video15_i2v  a random-weight tiny HunyuanVideo 1.5 image-to-video animating the shipped sources
    ltx2            GRPO LoRA on LTX-2 (video with audio) with Flow-Factory's t2av recipe (PickScore), one GPU
    tiny_ltx2       a random-weight tiny LTX-2 making video with audio (rewards get the audio), 5 frames, seconds

The tiny_* algorithm variants (tiny_ddpo, tiny_gae, tiny_group_ppo, tiny_group_ppo_alg2, tiny_group_ppo_sampled,
tiny_early_window, tiny_window4, tiny_nft, tiny_awm, tiny_dppo, tiny_grpo_guard, tiny_dgpo, tiny_dpo) are `tiny()` with only their method's fields changed: the main job's
prompts, sampler steps, group size, epochs and evaluation, so their evaluations compare with the main job's
(tests/test_variants.py checks the changed fields; docs/configs.md gives each one's measured result). A learning
rate differs from the main job's 2e-4 only where a measured sweep chose it, and the variant's docstring says so.
"""

# The method recipes and the private helpers the variants share, re-exported: benchmarks/scenes_study.py applies
# grpo._learning_group_ppo, grpo._algorithm2_group_ppo, grpo._diffusion_nft and grpo._diffusion_nft_kl to its arms.
from ddpo_group.config.variants._methods import (  # noqa: F401
    _algorithm2_group_ppo,
    _diffusion_nft,
    _diffusion_nft_kl,
    _learning_group_ppo,
)
from ddpo_group.config.variants.flow import (  # noqa: F401
    _tiny_flow,
    flux,
    flux2,
    flux2_klein,
    qwen_image,
    sd35,
    sd35_nft,
    tiny_flux,
    tiny_flux2,
    tiny_flux2_klein,
    tiny_qwen_image,
    tiny_sd3,
    tiny_sd3_dppo,
    tiny_sd3_grpo_guard,
    tiny_sd3_dgpo,
    tiny_sd3_dpo,
    tiny_sd_flow,
    tiny_zimage,
    tiny_zimage_turbo,
    zimage,
    zimage_turbo,
)
from ddpo_group.config.variants.next_misc import (  # noqa: F401
    qwen_image_edit_plus,
    sana_nft,
    tiny_hunyuan_video15,
    tiny_hunyuan_video15_i2v,
    ltx2,
    tiny_ltx2,
    tiny_qwen_image_edit_plus,
    tiny_sana,
)
from ddpo_group.config.variants.sd import ddpo, group_ppo, group_ppo_alg2, sd15, sdxl, tiny_sdxl
from ddpo_group.config.variants.tasks import (  # noqa: F401
    _geneval_task,
    sd35_geneval,
    sd35_nft_geneval,
    sd35_ocr,
    sd35_pickscore,
    tiny_geneval,
    tiny_scenes,
    tiny_scenes_flow,
    tiny_scenes_flow_nft,
    tiny_scenes_sd,
)
from ddpo_group.config.variants.tiny import (  # noqa: F401
    _tiny_common,
    test,
    tiny,
    tiny_all,
    tiny_awm,
    tiny_dgpo,
    tiny_dpo,
    tiny_ddpo,
    tiny_dppo,
    tiny_early_window,
    tiny_gae,
    tiny_group_ppo,
    tiny_group_ppo_alg2,
    tiny_group_ppo_sampled,
    tiny_grpo_guard,
    tiny_hacking,
    tiny_nft,
    tiny_one_prompt,
    tiny_squares,
    tiny_window4,
)
from ddpo_group.config.variants.video_edit import (  # noqa: F401
    _flow_factory_edit,
    flux_kontext,
    qwen_image_edit,
    tiny_flux_kontext,
    tiny_qwen_image_edit,
    tiny_wan,
    wan21_t2v_1_3b,
    wan21_t2v_14b,
)
from ddpo_group.config.variants.wan_next import (
    tiny_wan22_i2v,
    tiny_wan22_moe,
    tiny_wan_i2v,
    wan21_i2v,
    wan22_a14b_t2v,
    wan22_i2v,
)

# name -> variant, in the order `ddpo-group-train --help` lists them (and get_config's error names them sorted)
VARIANTS = {
    "sd15": sd15,
    "ddpo": ddpo,
    "group_ppo": group_ppo,
    "group_ppo_alg2": group_ppo_alg2,
    "tiny": tiny,
    "tiny_all": tiny_all,
    "tiny_squares": tiny_squares,
    "tiny_one_prompt": tiny_one_prompt,
    "tiny_ddpo": tiny_ddpo,
    "tiny_group_ppo": tiny_group_ppo,
    "tiny_window4": tiny_window4,
    "tiny_group_ppo_alg2": tiny_group_ppo_alg2,
    "tiny_gae": tiny_gae,
    "tiny_nft": tiny_nft,
    "tiny_awm": tiny_awm,
    "tiny_dppo": tiny_dppo,
    "tiny_grpo_guard": tiny_grpo_guard,
    "tiny_dgpo": tiny_dgpo,
    "tiny_dpo": tiny_dpo,
    "tiny_group_ppo_sampled": tiny_group_ppo_sampled,
    "tiny_early_window": tiny_early_window,
    "tiny_hacking": tiny_hacking,
    "test": test,
    "sd35": sd35,
    "flux": flux,
    "sd35_nft": sd35_nft,
    "tiny_sd3": tiny_sd3,
    "tiny_sd3_dppo": tiny_sd3_dppo,
    "tiny_sd3_grpo_guard": tiny_sd3_grpo_guard,
    "tiny_sd3_dgpo": tiny_sd3_dgpo,
    "tiny_sd3_dpo": tiny_sd3_dpo,
    "tiny_sd_flow": tiny_sd_flow,
    "tiny_flux": tiny_flux,
    "qwen_image": qwen_image,
    "tiny_qwen_image": tiny_qwen_image,
    "sd35_ocr": sd35_ocr,
    "wan21_t2v_1_3b": wan21_t2v_1_3b,
    "wan21_t2v_14b": wan21_t2v_14b,
    "tiny_wan": tiny_wan,
    "wan22_a14b_t2v": wan22_a14b_t2v,
    "wan21_i2v": wan21_i2v,
    "wan22_i2v": wan22_i2v,
    "tiny_wan22_moe": tiny_wan22_moe,
    "tiny_wan_i2v": tiny_wan_i2v,
    "tiny_wan22_i2v": tiny_wan22_i2v,
    "sd35_pickscore": sd35_pickscore,
    "sdxl": sdxl,
    "tiny_sdxl": tiny_sdxl,
    "flux_kontext": flux_kontext,
    "tiny_flux_kontext": tiny_flux_kontext,
    "qwen_image_edit": qwen_image_edit,
    "tiny_qwen_image_edit": tiny_qwen_image_edit,
    "tiny_geneval": tiny_geneval,
    "sd35_geneval": sd35_geneval,
    "sd35_nft_geneval": sd35_nft_geneval,
    "tiny_scenes": tiny_scenes,
    "tiny_scenes_sd": tiny_scenes_sd,
    "tiny_scenes_flow": tiny_scenes_flow,
    "tiny_scenes_flow_nft": tiny_scenes_flow_nft,
    "flux2": flux2,
    "flux2_klein": flux2_klein,
    "zimage": zimage,
    "zimage_turbo": zimage_turbo,
    "tiny_flux2": tiny_flux2,
    "tiny_flux2_klein": tiny_flux2_klein,
    "tiny_zimage": tiny_zimage,
    "tiny_zimage_turbo": tiny_zimage_turbo,
    "qwen_image_edit_plus": qwen_image_edit_plus,
    "tiny_qwen_image_edit_plus": tiny_qwen_image_edit_plus,
    "sana_nft": sana_nft,
    "tiny_sana": tiny_sana,
    "tiny_hunyuan_video15": tiny_hunyuan_video15,
    "tiny_hunyuan_video15_i2v": tiny_hunyuan_video15_i2v,
    "ltx2": ltx2,
    "tiny_ltx2": tiny_ltx2,
}


def get_config(name="sd15"):
    if name not in VARIANTS:
        raise ValueError(f"unknown config variant {name!r} in config/grpo.py; choose one of {sorted(VARIANTS)}")
    config = VARIANTS[name]()
    config.variant = name  # kept in the run's config.json: the report's headline names the variant
    return config

