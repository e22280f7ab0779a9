"""The named experiment configurations, one module per purpose; `ddpo_group/config/grpo.py` assembles them into
VARIANTS (the order `ddpo-group-train --help` lists them in) and keeps the map of them in its docstring.

    tiny.py        the shipped shapes-world model's main job (`tiny`), its demos and its algorithm variants; `test`
    sd.py          the UNet + DDIM family on the hub: SD 1.5 (sd15, ddpo, group_ppo*), SDXL
    flow.py        the flow-matching image families: SD3.5-Medium, FLUX.1-dev, Qwen-Image, and their tiny pipelines
    tasks.py       task presets: another reward and prompt set on a family's recipe (OCR, PickScore, GenEval, scenes)
    video_edit.py  text-to-video (Wan 2.1) and image editing (FLUX.1 Kontext, Qwen-Image-Edit)
    wan_next.py    Wan 2.2 A14B's two experts and Wan image-to-video, on video_edit.py's Wan 2.1 variants
    next_misc.py   issue 46's Qwen-Image-Edit-2509 (several sources), SANA, HunyuanVideo 1.5 (text- and
                   image-to-video), LTX-2 (video with audio)
    _methods.py    the method recipes a variant applies onto another's config (Group-PPO's two designs, DiffusionNFT)

A variant is a function taking nothing and returning a fresh ConfigDict; one derived from another calls it.
"""
