"""`finetune chat`: talk to a trained run, prompted exactly as it trained."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from finetune.cli.common import fail


def chat(
    path: Optional[Path] = typer.Argument(None, metavar="PATH", help="Run directory, or a merged / full model directory."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model directory or hub id (with --adapter; overrides the run's)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT adapter directory (overrides the run's adapter/)."),
    prompts: Optional[List[str]] = typer.Option(None, "--prompt", help="Answer this and exit (repeatable: one conversation, in order)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 (default): greedy, the same reply every time; > 0 samples."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (with --temperature > 0)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="alpaca, messages, sharegpt (the chat template, as messages) or text (default: what the run trained on)."),
    device: str = typer.Option("auto", "--device", help="auto (the GPU if there is one), cuda or cpu."),
    images: Optional[List[str]] = typer.Option(None, "--image", help="An image file shown with the first message (a vision-language model; repeatable). Interactive: /image PATH adds one to the next message."),
) -> None:
    """Talk to a trained model, with the prompt format it trained on (chat template or alpaca prompt).

    Loads base + adapter (QLoRA: the base in 4-bit, as it trained) or the merged model, on the GPU if
    there is one. Interactive: /reset starts over, /exit (or Ctrl-D) leaves. A vision-language model takes
    images (--image, /image PATH), placed before the message's text as the run trained.

    Example:

    \b
        $ finetune chat runs/demo --prompt "What is the capital of Russia?"
        loading runs/demo (lora adapter on builtin:tiny-llama) ...
        prompt format: alpaca (as the run trained), cpu
        The capital of is isrgenti.
        $ finetune chat merged/demo
        loading merged/demo ...
        loaded merged/demo (alpaca format, cpu); /reset starts over, /exit leaves
        you> What is the capital of Russia?
        The capital of is isrgenti.
        $ finetune chat runs/tiny-vlm --image recipes/data/images/red_28x28.png --prompt "What colour is this?"
    """
    from finetune import quiet

    quiet.no_progress_bars()
    from finetune.use.chat import answer, load_chat_model, resolve_source
    from finetune.use.conversation import Conversation
    from finetune.use.images import checked_images, image_problem

    if path is None and base is None:
        raise fail("give a run directory, a model directory, or --base (and --adapter)", 2)
    source = resolve_source(path, base, adapter, fmt)
    typer.echo(f"loading {source.label} ...", err=True)  # seconds to a minute: say so (issue 24)
    model = load_chat_model(source, device)
    conversation = Conversation(model.tokenizer, model.fmt, vision=model.vision)
    pending = checked_images(list(images or []), model.vision)  # shown with the next message

    def say(user: str) -> None:
        shown = tuple(pending)
        pending.clear()
        reply = answer(model, conversation, user, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed, on_text=lambda text: typer.echo(text, nl=False), images=shown)
        typer.echo("")
        if reply.dropped_turns:
            typer.echo(f"(the {reply.dropped_turns} oldest turn(s) no longer fit the model's context and were left out)", err=True)

    if prompts:
        typer.echo(f"prompt format: {model.fmt} ({_format_why(source, fmt)}), {model.device}", err=True)
        for prompt in prompts:
            say(prompt)
        return
    typer.echo(f"loaded {model.label} ({model.fmt} format, {model.device}); /reset starts over, /exit leaves", err=True)
    while True:
        try:
            user = input("you> ")
        except EOFError:
            typer.echo("")
            return
        command = user.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            conversation.reset()
            typer.echo("(conversation cleared)", err=True)
            continue
        if command.startswith("/image "):
            path = command[len("/image "):].strip()
            problem = image_problem(path, model.vision)  # said, and the conversation goes on
            if problem:
                typer.echo(f"error: {problem}", err=True)
            else:
                pending.extend(checked_images([path], model.vision))
                typer.echo(f"({len(pending)} image(s) go with your next message)", err=True)
            continue
        if command:
            say(user)


def _format_why(source, fmt: Optional[str]) -> str:
    from finetune.use.chat import format_why

    if fmt is not None:
        return "--format"
    return format_why(source.recipe) if source.recipe is not None else "the model's own"
