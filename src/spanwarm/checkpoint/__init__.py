"""The checkpoint model: safetensors headers and checkpoint resolution, placements (which
elements a rank holds), tensor layouts (where they lie in a file), conversions (which
source bytes a converted tensor reads), and the strided spans they come to. Pure: no
daemon, no torch (but where a module says so)."""
