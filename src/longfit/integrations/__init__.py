"""longfit inside training loops that are not longfit's: `hf` turns a transformers Trainer or TRL SFTTrainer run
into a longfit run through the Trainer's own extension points."""
