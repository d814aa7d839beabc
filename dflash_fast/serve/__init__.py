"""What the serving engines load: the export layouts, how each engine reads them, and the gated export itself.

    layouts     the speculators and z-lab layouts (config.json of each) and their JSON schemas
    engines     how speculators, vLLM and SGLang read an export; check_servable, config_from_export
    export      an export written (gated: read back as the engines read it) and loaded back

serve/ sits below train/: a run may start from an export (model.init_from) and ends by writing one.
"""
