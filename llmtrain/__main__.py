from llmtrain.cli import main

if __name__ == "__main__":
    main()
