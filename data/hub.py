"""A ``--dataset`` or ``--model`` that is not on this machine: a hub id, read from the hub; imported only then."""

import datasets

from fabric_utils.errors import UserError, first_line


def load_hub_dataset(source: str) -> datasets.DatasetDict:
    try:
        return datasets.load_dataset(source)
    except Exception as err:  # the hub raises many kinds; all mean the same to a user here
        raise UserError(f"could not load dataset {source!r} from the hub ({type(err).__name__}); offline, pass a "
                        f"local file or folder to --dataset") from err


def check_hub_model(source: str) -> None:
    """A model that is no local folder: a hub id in the local cache or on a hub that answers one request (without
    network and without the model, the run stops here at once, not after the minute of retries of the hub's
    download); a path is refused."""
    if source.startswith((".", "/", "~")):
        raise UserError(f"model path {source} does not exist (pass a hub id or an existing folder to --model)")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if try_to_load_from_cache(source, "config.json") is None:
            get_hf_file_metadata(hf_hub_url(source, "config.json"))
    except HfHubHTTPError:  # the hub answered (no such model, gated): from_pretrained says which
        pass
    except Exception as err:  # offline mode, no network, not a hub id: each kind the hub's client raises
        raise UserError(f"model {source} is not on this machine and the hub cannot give it ({first_line(err)}): "
                        f"pass --model PATH, a local model folder") from err
